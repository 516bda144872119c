"""``attncomp.flex``'s specs on the cuda backend against the float64 interpreter: a 2-D neighbourhood
mask by ``//`` and ``%`` and an ALiBi score_mod reading captured slopes, recorded from FlexAttention
functions as ``flex_attention`` records them; bf16 on the tensor-core kernels, forward and gradients
(the captured slopes' included)."""

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import attncomp as ac  # noqa: E402
from attncomp.flex.recording import record  # noqa: E402
from attncomp.flex.specs import build  # noqa: E402
from attncomp.testing import TOLERANCE, relative_error  # noqa: E402
from tests.cuda_sim.helpers import host  # noqa: E402

IMAGE = 8
PIPELINE = "cse,softmax-fusion,flash-tiling{block_q=32,block_k=32},mask-elimination,canonicalize,cse,dce"


def test_a_recorded_neighbourhood_and_alibi_match_the_interpreter():
    slopes = torch.tensor([0.5, 0.125])

    def neighbours(b, h, q_idx, kv_idx):
        return ((q_idx // IMAGE - kv_idx // IMAGE).abs() <= 1) & ((q_idx % IMAGE - kv_idx % IMAGE).abs() <= 1)

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    score, mask, captured = record(alibi, neighbours)
    assert [t is slopes for t in captured] == [True]
    spec = build(score, mask, (("float32", 1),), lse=False)
    rng = np.random.default_rng(0)
    bf16 = ml_dtypes.bfloat16
    q = rng.standard_normal((1, 2, 48, 64)).astype(bf16)
    k, v = (rng.standard_normal((1, 1, 48, 64)).astype(bf16) for _ in range(2))
    args = [q, k, v, slopes.numpy()]
    fn = ac.compile(spec, backend="cuda", pipeline=PIPELINE, scale=0.125)
    reference = ac.compile(spec, backend="interp", pipeline=PIPELINE, scale=0.125)
    want, want_pullback = reference.vjp(*args)
    out = host(fn(*args))
    assert relative_error(np.asarray(out, np.float64), np.asarray(want, np.float64)) < TOLERANCE["bf16"]
    assert fn.for_dtype("bf16").compilation.program.attention[0].last_choice.async_copies  # tensor cores
    _, pullback = fn.vjp(*args)
    cotangent = rng.standard_normal(want.shape).astype(bf16)
    for got, expected in zip(pullback(cotangent), want_pullback(cotangent)):
        assert (
            relative_error(np.asarray(host(got), np.float64), np.asarray(expected, np.float64)) < 2 * TOLERANCE["bf16"]
        )
