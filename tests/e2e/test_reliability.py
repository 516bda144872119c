"""Edge-case inputs on the interpreter and the CPU backend, fused and unfused."""

import numpy as np
import pytest

import attncomp as ac
from attncomp.testing import worst_error
from tests.passes import specs

BACKENDS = [("interp", None), ("cpu", None), ("cpu", "")]
IDS = ["interp", "cpu-fused", "cpu-unfused"]


def _list(x):
    return list(x) if isinstance(x, tuple) else [x]


@pytest.mark.parametrize("backend,pipeline", BACKENDS, ids=IDS)
@pytest.mark.parametrize("T,S", [(0, 5), (5, 0), (0, 0)])
def test_empty_sequences_give_empty_or_zero_results(backend, pipeline, T, S):
    fn = ac.compile(specs.spelled_gqa_lse, backend=backend, pipeline=pipeline)
    q = np.zeros((1, 2, T, 4), np.float32)
    k = np.zeros((1, 1, S, 4), np.float32)
    out, lse = fn(q, k, k)
    assert out.shape == (1, 2, T, 4) and lse.shape == (1, 2, T)
    assert np.all(out == 0) and np.all(lse == -np.inf)  # no key at all: as if every key were masked


@pytest.mark.parametrize("backend,pipeline", BACKENDS, ids=IDS)
def test_nan_and_inf_propagate_like_sdpa(backend, pipeline):
    fn = ac.compile(specs.causal, backend=backend, pipeline=pipeline)
    x = np.random.default_rng(0).standard_normal((1, 1, 6, 4)).astype(np.float32)
    k = x.copy()
    k[0, 0, 2, 1] = np.nan  # key 2 is seen by rows 2.. (causal): those rows are NaN, earlier rows are not
    rows = np.isnan(fn(x, k, x)).any(axis=-1)[0, 0]
    np.testing.assert_array_equal(rows, [False, False, True, True, True, True])
    v = x.copy()
    v[0, 0, 3, 0] = np.inf
    out = fn(x, x, v)
    # rows that see value 3 are not finite in that channel; the other channels of every row are finite
    assert not np.any(np.isfinite(out[0, 0, 3:, 0]))
    assert np.all(np.isfinite(out[0, 0, :, 1:]))


@pytest.mark.parametrize("backend,pipeline", BACKENDS, ids=IDS)
def test_huge_logits_stay_finite_and_right(backend, pipeline):
    fn = ac.compile(specs.causal, backend=backend, pipeline=pipeline)
    x = np.random.default_rng(1).standard_normal((1, 2, 30, 8)).astype(np.float32)
    big = x * 1e4 / np.abs(x).max()
    out = fn(big, big, x)
    assert np.all(np.isfinite(out))
    assert worst_error([out], [ac.interpret(specs.causal, big, big, x)]) < 1e-4


@pytest.mark.parametrize("backend,pipeline", BACKENDS, ids=IDS)
def test_read_only_and_negative_stride_views(backend, pipeline):
    fn = ac.compile(specs.causal, backend=backend, pipeline=pipeline)
    x = np.random.default_rng(2).standard_normal((1, 2, 21, 8)).astype(np.float32)
    read_only = x.copy()
    read_only.setflags(write=False)
    reversed_rows = x[:, :, ::-1]
    want = ac.interpret(specs.causal, read_only, reversed_rows, reversed_rows)
    assert worst_error([fn(read_only, reversed_rows, reversed_rows)], [want]) < 1e-5


@pytest.mark.parametrize("backend,pipeline", BACKENDS, ids=IDS)
def test_calls_never_modify_inputs(backend, pipeline):
    fn = ac.compile(specs.causal_alibi, backend=backend, pipeline=pipeline)
    rng = np.random.default_rng(3)
    args = [rng.standard_normal((1, 2, 9, 4)).astype(np.float32) for _ in range(3)] + [np.ones(2, np.float32)]
    before = [a.tobytes() for a in args]
    fn(*args)
    assert [a.tobytes() for a in args] == before
