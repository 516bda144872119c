"""bf16 and generic specs on the cuda backend: query, key and value kept as bf16 patterns, other bf16 values
widened at the call's boundary; kernels compute in float32."""

import ml_dtypes
import numpy as np
import pytest

import attncomp as ac
from attncomp.testing import TOLERANCE, worst_error
from tests.passes.specs import generic_alibi as alibi


def inputs(dtype, T=9):
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal((1, 2, T, 8)) for _ in range(3)] + [np.array([0.5, 0.25])]
    return [a.astype(dtype) for a in arrays]


def test_a_generic_spec_in_every_float_type():
    fn = ac.compile(alibi, backend="cuda")
    reference = ac.compile(alibi, backend="interp")
    for name, dtype in (("bf16", ml_dtypes.bfloat16), ("f16", np.float16), ("f32", np.float32)):
        args = inputs(dtype)
        got = fn(*args)
        assert got.dtype == np.dtype(dtype)
        want = reference.for_dtype(name).compilation.run(args, exact=True)
        assert worst_error([got], want) < TOLERANCE[name], name
    source = fn.for_dtype("bf16").source
    assert "bfloat16" not in source and "widen_bf16(" in source  # bf16 patterns, computed in float32


def test_a_bf16_decoder_on_the_device():
    fn = ac.compile(alibi, backend="cuda")
    args = inputs(ml_dtypes.bfloat16, T=10)
    dec = fn.decoder(16)
    outs = [dec(*(x[:, :, a:b] for x in args[:3]), args[3]) for a, b in [(0, 7), (7, 8), (8, 10)]]
    got = np.concatenate(outs, axis=2)
    want = ac.compile(alibi, backend="interp").for_dtype("bf16").compilation.run(args, exact=True)
    assert worst_error([got], want) < TOLERANCE["bf16"]


def test_a_bf16_paged_decoder_on_the_device():
    fn = ac.compile(alibi, backend="cuda")
    args = inputs(ml_dtypes.bfloat16, T=10)
    server = fn.paged_decoder(page_size=4, num_pages=8, dtype="bf16")
    seq = server.new()
    outs = [server.step({seq: (*(x[:, :, a:b] for x in args[:3]), args[3])})[seq] for a, b in [(0, 6), (6, 10)]]
    got = np.concatenate(outs, axis=2)
    want = ac.compile(alibi, backend="interp").for_dtype("bf16").compilation.run(args, exact=True)
    assert worst_error([got], want) < TOLERANCE["bf16"]


def test_a_bf16_decoder_keeps_its_device_cache_in_16_bits():
    """Keys and values appended as they came (bf16 patterns, never widened): the cache holds half the
    bytes, reads back as the bf16 it was given, and a failed step leaves it as it was."""
    from attncomp.backends.numba_cuda.host.arrays import Bf16Bits

    fn = ac.compile(alibi, backend="cuda")
    args = inputs(ml_dtypes.bfloat16, T=10)
    dec = fn.decoder(16, dtype="bf16")
    assert dec.fn.program.bf16_bits == {0, 1, 2, 4, 5}  # q, k, v, the caches; not the slopes
    outs = [dec(*(x[:, :, a:b] for x in args[:3]), args[3]) for a, b in [(0, 7), (7, 8), (8, 10)]]
    cache = dec.cache
    assert all(isinstance(c, Bf16Bits) and c.bits.dtype == np.uint16 for c in cache.values())
    np.testing.assert_array_equal(cache["k_cache"].copy_to_host(), args[1])
    np.testing.assert_array_equal(cache["v_cache"].copy_to_host(), args[2])
    before = dec.cache["k_cache"].copy_to_host()
    with pytest.raises(ac.ShapeError, match="slopes"):
        dec(*(x[:, :, 9:10] for x in args[:3]), args[3][:1])
    assert dec.length == 10
    np.testing.assert_array_equal(dec.cache["k_cache"].copy_to_host(), before)
    assert "widen_bf16(" in dec.fn.source  # the attention reads the cache's patterns
    got = np.concatenate(outs, axis=2)
    want = ac.compile(alibi, backend="interp").for_dtype("bf16").compilation.run(args, exact=True)
    assert worst_error([got], want) < TOLERANCE["bf16"]


def test_the_simulator_moves_bf16_arrays_but_has_no_bf16_conversions():
    """numba-cuda 0.30's simulator copies ``ml_dtypes.bfloat16`` device arrays and views them as their
    patterns, but its ``numba.cuda.bf16`` is a stub (no conversions, ``bfloat16 = None``) and a kernel
    cannot make a bf16 of a float32 (``cuda.bfloat16(x)``): no kernel rounds to bf16 with the library
    there, so the kernels keep bf16 as 16-bit words and ``warp.round_bf16`` (docs/architecture.md,
    "bf16 on the device").  When this fails, the library's conversions may run in the simulator."""
    import numba.cuda.bf16 as library
    from numba import config, cuda

    if not config.ENABLE_CUDASIM:
        pytest.skip("a check of the simulator: on a GPU, ml_dtypes arrays cannot be copied as themselves")
    values = np.array([1.0, -2.5, 3.140625], dtype=ml_dtypes.bfloat16)
    device = cuda.to_device(values)
    assert np.array_equal(device.view(np.uint16).copy_to_host(), values.view(np.uint16))
    assert library.bfloat16 is None and not hasattr(library, "float32_to_bfloat16_rn")

    @cuda.jit
    def rounded(out, x):
        out[0] = cuda.bfloat16(x[0])

    with pytest.raises((AttributeError, NotImplementedError)):  # no cuda.bfloat16, or a type that cannot cast
        rounded[1, 1](cuda.device_array(1, ml_dtypes.bfloat16), cuda.to_device(np.ones(1, np.float32)))
