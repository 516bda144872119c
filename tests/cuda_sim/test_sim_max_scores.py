"""Each row's max score (``ac.max(s, axis=-1)`` beside the softmax, a result of the fused attention) on
the cuda backend against the float64 interpreter: the scalar kernel with key splits (a decoding
step), the tensor cores' staged and asynchronous-copy kernels (whole chunks in the main loop, which
scales the products' max), grouped heads packed into one tile; rows that see no key give ``-inf``.
And the main loop's online softmax keeps its reference max in the scores' units: scores in the
hundreds neither overflow nor vanish."""

import ml_dtypes
import numpy as np
import pytest

import attncomp as ac
from attncomp.testing import TOLERANCE, relative_error
from tests.cuda_sim.helpers import host

BF16 = ml_dtypes.bfloat16


@ac.spec
def causal_with_max(
    q: ac.floating["B", "H", "T", "D"], k: ac.floating["B", "KV", "S", "D"], v: ac.floating["B", "KV", "S", "D"]
):
    n_rep = q.shape[1] // k.shape[1]
    s = (q @ ac.repeat_kv(k, n_rep).mT) * (q.shape[-1] ** -0.5)
    b, h, i, j = ac.index(s)
    s = ac.where((j <= i + s.shape[-1] - s.shape[-2]) & (i != 3), s, -ac.inf)
    return ac.softmax(s, axis=-1) @ ac.repeat_kv(v, n_rep), ac.max(s, axis=-1)


@pytest.mark.parametrize(
    "dtype,queries,keys,kernel",
    [
        (np.float32, 1, 300, "scalar, key splits"),
        (BF16, 40, 48, "tensor cores"),
        (BF16, 2, 300, "grouped heads packed"),
        (BF16, 128, 128, "main loop"),
    ],
)
def test_each_rows_max_score_matches_the_interpreter(dtype, queries, keys, kernel):
    rng = np.random.default_rng(queries)
    q = rng.standard_normal((1, 4, queries, 64)).astype(dtype)
    k, v = (rng.standard_normal((1, 2, keys, 64)).astype(dtype) for _ in range(2))
    want_out, want_max = ac.compile(causal_with_max, backend="interp", pipeline="")(q, k, v)
    out, top = (np.asarray(host(x), np.float64) for x in ac.compile(causal_with_max, backend="cuda")(q, k, v))
    assert relative_error(out, np.asarray(want_out, np.float64)) < TOLERANCE["bf16" if dtype is BF16 else "f32"]
    hidden = np.isneginf(np.asarray(want_max))
    assert np.array_equal(np.isneginf(top), hidden) and hidden.any() == (queries > 3)  # row 3 sees no key
    assert np.abs(top[~hidden] - np.asarray(want_max, np.float64)[~hidden]).max() < 1e-5


@ac.spec
def causal(q: ac.floating["B", "H", "T", "D"], k: ac.floating["B", "H", "S", "D"], v: ac.floating["B", "H", "S", "D"]):
    s = (q @ k.mT) * (q.shape[-1] ** -0.5)
    b, h, i, j = ac.index(s)
    return ac.softmax(ac.where(j <= i + s.shape[-1] - s.shape[-2], s, -ac.inf), axis=-1) @ v


@pytest.mark.parametrize("sign", [1, -1])
def test_scores_in_the_hundreds_in_the_main_loop(sign):
    """Whole chunks of full tiles (the main loop, which scales the products' max): every score near
    ``sign * 260``.  A reference max in the exponent's units (times log2 e) made the weights vanish
    (260: wrong outputs) or overflow (-260: NaN) there."""
    rng = np.random.default_rng(5)
    q = (np.full((1, 2, 64, 64), sign * 6.5) + 0.01 * rng.standard_normal((1, 2, 64, 64))).astype(BF16)
    k = (np.full((1, 2, 128, 64), 5.0) + 0.01 * rng.standard_normal((1, 2, 128, 64))).astype(BF16)
    v = rng.standard_normal((1, 2, 128, 64)).astype(BF16)
    fn = ac.compile(causal, backend="cuda")
    out = np.asarray(host(fn(q, k, v)), np.float64)
    assert fn.for_dtype("bf16").compilation.program.attention[0].last_choice.async_copies
    want = np.asarray(ac.compile(causal, backend="interp", pipeline="")(q, k, v), np.float64)
    assert np.isfinite(out).all() and relative_error(out, want) < TOLERANCE["bf16"]


def test_the_paged_decoders_cascade_merges_each_rows_max():
    """Two sequences sharing a prompt's pages: the shared prefix's partial results (its max among
    them) merge with each sequence's own, read in place from the device pool."""
    from tests.e2e.test_max_scores import assert_results_match, causal_window_with_max, fork_and_step

    decoder, results = fork_and_step(causal_window_with_max, "cuda", host)
    assert decoder.cascades == 1
    for got, want, what in results:
        assert_results_match(got, want, what)
