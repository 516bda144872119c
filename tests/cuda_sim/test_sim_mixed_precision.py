"""Mixed precision on the cuda backend: float32 parameters in a bf16 or f16 attention fuse, their
scores computed in float32, and the call returns the values' type (tests/e2e/test_mixed_precision.py
holds the same specs on the other backends)."""

import ml_dtypes
import numpy as np
import pytest

import attncomp as ac
from attncomp.testing import TOLERANCE, worst_error
from tests.e2e.test_mixed_precision import (
    CONSTANT_SLOPE,
    EVERY_ID,
    EVERY_SPEC,
    alibi_f32_slopes,
    assert_fused,
    exact,
    parameter,
)

NUMPY = {"f16": np.float16, "bf16": ml_dtypes.bfloat16}


def small_inputs(spec: ac.Spec, dtype: str, T: int = 10) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    qkv = [(rng.standard_normal((1, 2, T, 8)) * 2).astype(NUMPY[dtype]) for _ in range(3)]
    return qkv + parameter(spec, rng)


@pytest.mark.parametrize("spec", EVERY_SPEC, ids=EVERY_ID)
def test_float32_parameters_in_16_bits(spec):
    fn = ac.compile(spec, backend="cuda")
    for dtype in ("bf16", "f16"):
        args = small_inputs(spec, dtype)
        got = fn(*args)
        assert got.dtype == NUMPY[dtype]
        assert_fused(fn, dtype)
        assert worst_error([got], exact(spec, dtype, args)) < TOLERANCE[dtype], dtype


@pytest.mark.parametrize("spec", EVERY_SPEC, ids=EVERY_ID)
def test_float32_parameters_with_gradients(spec):
    """Gradients in each argument's type (f16 for q, k, v; float32 for the parameter), following the
    float32 interpreter's."""
    fn = ac.compile(spec, backend="cuda")
    args = small_inputs(spec, "f16")
    out, pullback = fn.vjp(*args)
    assert out.dtype == np.float16
    cotangent = np.random.default_rng(1).standard_normal(out.shape).astype(np.float16)
    grads = pullback(cotangent)
    assert [g.dtype for g in grads] == [x.dtype for x in args]
    reference = ac.compile(spec, backend="interp")
    _, pullback32 = reference.vjp(*(x.astype(np.float32) for x in args))
    assert worst_error(grads, pullback32(cotangent.astype(np.float32))) < TOLERANCE["f16"]


@pytest.mark.parametrize("spec", [alibi_f32_slopes, CONSTANT_SLOPE], ids=["f32_slopes", "constant"])
def test_a_bf16_decoder(spec):
    fn = ac.compile(spec, backend="cuda")
    args = small_inputs(spec, "bf16")
    dec = fn.decoder(16)
    outs = [dec(*(x[:, :, a:b] for x in args[:3]), *args[3:]) for a, b in [(0, 7), (7, 8), (8, 10)]]
    got = np.concatenate(outs, axis=2)
    assert got.dtype == NUMPY["bf16"]
    assert worst_error([got], exact(spec, "bf16", args)) < TOLERANCE["bf16"]
