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


@ac.spec
def last_keys(
    q: ac.f32["B", "H", "T", "D"], k: ac.f32["B", "H", "S", "D"], v: ac.f32["B", "H", "S", "D"], *, keep: int = 64
):
    s = (q @ k.mT) * q.shape[-1] ** -0.5
    b, h, i, j = ac.index(s)
    return ac.softmax(ac.where(j >= k.shape[-2] - keep, s, -ac.inf)) @ v


def test_flat_indices_past_32_bits(tmp_path):
    """Keys of more than 2**31 elements (8 GiB): the visible keys sit past flat index 2**31.

    The keys are a memory map of a sparse file, so only the pages the kernel reads take memory:
    ``j >= S - 64`` lets mask-elimination start the key loop at the last tiles.  A kernel that
    indexed with 32-bit integers would wrap to another row (zeros here) or outside the map.
    """
    S, D = 2**25 + 64, 64
    path = tmp_path / "keys.f32"
    with open(path, "wb") as file:
        file.truncate(S * D * 4)
    if path.stat().st_blocks * 512 >= S * D * 4 // 2:
        pytest.skip("the temporary directory's file system has no sparse files")
    keys = np.memmap(path, dtype=np.float32, mode="r+", shape=(1, 1, S, D))
    rng = np.random.default_rng(0)
    tail = rng.standard_normal((64, D)).astype(np.float32)
    keys[0, 0, -64:] = tail
    keys.flush()
    assert (S - 64) * D >= 2**31  # the first visible key element is past the largest int32
    keys = np.memmap(path, dtype=np.float32, mode="r", shape=(1, 1, S, D))
    q = rng.standard_normal((1, 1, 3, D)).astype(np.float32)
    out = ac.compile(last_keys, backend="cpu")(q, keys, keys)
    scores = q[0, 0].astype(np.float64) @ tail.T.astype(np.float64) / np.sqrt(D)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    want = (weights / weights.sum(axis=-1, keepdims=True)) @ tail
    assert worst_error([out[0, 0]], [want]) < 1e-5
