"""Repeated calls bind by the key of their arguments; every bad input still gets the checked way's error."""

import numpy as np
import pytest

import attncomp as ac
from attncomp.ir.binding import REMEMBERED_KEYS
from tests.passes import specs


@pytest.fixture(scope="module")
def causal():
    return ac.compile(specs.causal, backend="cpu")


def inputs(T=5, S=5, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(dtype) for shape in ((1, 2, T, 8), (1, 2, S, 8), (1, 2, S, 8))]


def test_repeated_shapes_bind_by_their_key(causal):
    q, k, v = inputs()
    first = causal(q, k, v)
    again = causal(q, k, v)  # a first call may compile: it binds the checked way; this one remembers
    binder = causal.compilation.binding()
    seen = len(binder.seen)
    np.testing.assert_array_equal(first, again)
    q2, k2, v2 = inputs(seed=1)  # same key, new values
    np.testing.assert_allclose(causal(q2, k2, v2), ac.interpret(specs.causal, q2, k2, v2), rtol=1e-4, atol=1e-5)
    assert len(binder.seen) == seen


def test_a_new_shape_dtype_or_stride_binds_again(causal):
    binder = causal.compilation.binding()
    causal(*inputs())
    causal(*inputs())  # a first call binds the checked way; this key is now remembered
    before = len(binder.seen)
    q, k, v = inputs(T=7, S=3)  # new sizes
    np.testing.assert_allclose(causal(q, k, v), ac.interpret(specs.causal, q, k, v), rtol=1e-4, atol=1e-5)
    q16, k16, v16 = inputs(dtype=np.float16)  # a dtype that converts without loss
    np.testing.assert_allclose(causal(q16, k16, v16), ac.interpret(specs.causal, q16, k16, v16), rtol=1e-3, atol=1e-3)
    wide = np.zeros((1, 2, 5, 16), np.float32)
    wide[..., ::2] = inputs()[0]
    strided = wide[..., ::2]  # the same shape, other strides
    np.testing.assert_allclose(causal(strided, *inputs()[1:]), causal(*inputs()), rtol=1e-6)
    assert len(binder.seen) == before + 3
    assert len(binder.seen) <= REMEMBERED_KEYS


def test_bad_input_after_a_good_call_gets_the_same_error(causal):
    q, k, v = inputs()
    causal(q, k, v)
    with pytest.raises(ac.ShapeError, match=r"^k: dimension D is 4, but q gave D = 8"):
        causal(q, k[..., :4], v)
    with pytest.raises(TypeError, match=r"^v: expected f32 \(float32\) elements, got float64$"):
        causal(q, k, v.astype(np.float64))
    with pytest.raises(TypeError, match=r"takes 3 arguments"):
        causal(q, k)
    np.testing.assert_array_equal(causal(q, k, v), causal(q, k, v))  # and the good key still runs


def test_decoder_steps_bind_once_per_shape(causal):
    """Each step has a new cached length; the arrays' key stays the same, so steps after the first
    bind by the key (the length checked against the constraints), and give the full call's rows."""
    q, k, v = inputs(T=12, S=12, seed=4)
    dec = causal.decoder(max_len=12)
    steps = [dec(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1]) for t in range(12)]
    np.testing.assert_allclose(np.concatenate(steps, axis=2), causal(q, k, v), rtol=1e-5, atol=1e-6)
    assert len(dec.fn.binding().seen) <= 2  # not one key per cached length
    with pytest.raises(ValueError, match="exceeds max_len = 12"):
        dec(q[:, :, :1], k[:, :, :1], v[:, :, :1])
    with pytest.raises(TypeError, match="q: expected f32"):
        dec(q[:, :, :1].astype(np.float64), k[:, :, :1], v[:, :, :1])
