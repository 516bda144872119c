"""8-bit key/value caches on the cuda backend (``fn.decoder(max_len, cache="f8e4m3" | "f8e5m2")``).

The device holds the codes as bytes and a float32 scale per (token, head) row; appends quantise new
rows in a kernel with the arithmetic of ``ir.quantized.quantize`` (its codes and scales bit for bit,
as the interpreter's decoder stores them and the CPU's, ``tests/e2e/test_8bit_cache.py``), and the
scalar attention kernels decode the codes as they stage keys and values, times their row's scale.
Decoded steps agree with the float64 interpreter run on the dequantised cache at the CPU's
tolerance."""

import ml_dtypes
import numpy as np
import pytest
from numba import cuda

import attncomp as ac
from attncomp.backends.numba_cuda.fp8_codes import decode_f8e4m3, decode_f8e5m2, encode_f8e4m3, encode_f8e5m2
from attncomp.backends.numba_cuda.host import arrays
from attncomp.ir.quantized import CACHE_MAX, dequantize
from attncomp.ir.types import NUMPY_DTYPES
from tests.e2e.test_8bit_cache import causal_gqa, relative

CACHES = ["f8e4m3", "f8e5m2"]
DECODE = {"f8e4m3": decode_f8e4m3, "f8e5m2": decode_f8e5m2}
ENCODE = {"f8e4m3": encode_f8e4m3, "f8e5m2": encode_f8e5m2}


@pytest.mark.parametrize("cache", CACHES)
def test_every_code_decodes_to_the_ml_dtypes_value_and_encodes_back(cache):
    """All 256 codes, decoded on the device, are ``ml_dtypes``'s float32 bit for bit (NaNs and, for
    e5m2, infinities included); their values and the midpoints between neighbours (ties go to the
    even code) encode to ``ml_dtypes``'s codes of the saturated value."""
    decode, encode = DECODE[cache], ENCODE[cache]

    @cuda.jit
    def kernel(codes, decoded, x, encoded):
        i = cuda.grid(1)
        if i < codes.size:
            decoded[i] = decode(codes[i])
        if i < x.size:
            encoded[i] = encode(x[i])

    codes = np.arange(256, dtype=np.uint8)
    values = codes.view(NUMPY_DTYPES[cache]).astype(np.float32)
    finite = np.sort(values[np.isfinite(values)])
    top = np.float32(CACHE_MAX[cache])
    x = np.concatenate([values, (finite[:-1] + finite[1:]) / 2, np.float32([np.nan, -np.nan, 1e-40, -1e-45])])
    x = np.where(np.isnan(x), x, np.clip(x, -top, top)).astype(np.float32)
    decoded, encoded = np.zeros(256, np.float32), np.zeros(x.size, np.uint8)
    kernel[(x.size + 127) // 128, 128](codes, decoded, x, encoded)
    np.testing.assert_array_equal(decoded.view(np.uint32), values.view(np.uint32))
    np.testing.assert_array_equal(encoded, x.astype(NUMPY_DTYPES[cache]).view(np.uint8))


@pytest.fixture(scope="module")
def compiled():
    return {backend: ac.compile(causal_gqa, backend=backend) for backend in ("cuda", "interp")}


def steps(fn, cache, q, k, v, cuts, dtype):
    """A prefill up to ``cuts[0]``, then steps between the cuts: the outputs (float64) and the decoder."""
    dec = fn.decoder(max_len=q.shape[2] + 2, dtype=dtype, cache=cache)
    outs = [np.asarray(dec(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b])) for a, b in zip([0, *cuts], cuts)]
    return np.concatenate(outs, axis=2).astype(np.float64), dec


def on_host(dec) -> dict[str, np.ndarray]:
    return {name: x if isinstance(x, np.ndarray) else x.copy_to_host() for name, x in dec.cache.items()}


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_decode_steps_agree_with_the_interpreter_and_store_its_codes(compiled, cache, dtype):
    """GQA (2 key/value heads, 2 query heads each): a prefill of 5 tokens, single tokens, and a step
    of 3.  The codes are the interpreter's decoder's (``ir.quantized.quantize``'s) bit for bit and the
    scales equal; the outputs are the interpreter's on the dequantised cache (float32's tolerance,
    bf16's for bf16 results)."""
    rng = np.random.default_rng(len(cache) + len(dtype))
    kv, group, d, n = 2, 2, 16, 10
    floats = NUMPY_DTYPES[dtype]
    q = rng.standard_normal((1, kv * group, n, d)).astype(floats)
    k, v = ((rng.standard_normal((1, kv, n, d)) * 3).astype(floats) for _ in range(2))
    k[0, 1, 2] = 0.0  # a row of zeros: scale 0, codes 0
    cuts = [5, 6, 7, 10]
    got, dec = steps(compiled["cuda"], cache, q, k, v, cuts, dtype)
    assert isinstance(dec.cache["k_cache"], arrays.CacheCodes)
    stored = on_host(dec)
    _, reference = steps(compiled["interp"], cache, q, k, v, cuts, dtype)
    for name, want in on_host(reference).items():
        assert stored[name].dtype == want.dtype, name
        np.testing.assert_array_equal(stored[name].view(np.uint8), want.view(np.uint8), err_msg=name)
    k_read = dequantize(stored["k_cache"], stored["k_scale"])
    v_read = dequantize(stored["v_cache"], stored["v_scale"])
    want = ac.interpret(causal_gqa, q.astype(np.float32), k_read, v_read)
    assert relative(got, want) < (2e-5 if dtype == "f32" else 1e-2)
    assert 1e-4 < relative(got, ac.interpret(causal_gqa, q.astype(np.float32), k, v))  # the cache was quantised


def test_the_device_cache_takes_about_half_the_bytes_of_a_bf16_one(compiled):
    """Head dim 128: a byte per element and a float32 scale per row, 132 / 256 of bf16's bytes."""
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((1, 1, 2, 128)).astype(ml_dtypes.bfloat16) for _ in range(3))
    held = {}
    for cache in (None, "f8e4m3"):
        dec = compiled["cuda"].decoder(max_len=4, dtype="bf16", cache=cache)
        dec(q, k, v)
        held[cache] = sum(arrays.device_view(x).nbytes for x in dec.cache.values())
    assert held["f8e4m3"] / held[None] == pytest.approx(132 / 256)
    assert 0.5 < held["f8e4m3"] / held[None] < 0.53


@pytest.mark.parametrize("cache", CACHES)
def test_8bit_pages_agree_with_the_interpreter_on_the_dequantised_pool(compiled, cache):
    """A paged decoder with 8-bit pages on the device: codes as bytes and a float32 scale per
    (token, head) row, the interpreter's pool's bit for bit (``ir.quantized.quantize``'s); two ragged
    sequences and a fork (its shared last page copied when it appends), in pages out of order, each
    step as the interpreter computes it on the dequantised pool."""
    from tests.e2e.test_8bit_pages import Served

    got, pools = {}, {}
    for backend in ("cuda", "interp"):
        s = Served(compiled[backend], cache, 2, 16, page_size=4, num_pages=16, seed=5)
        a, b = s.new(), s.new()
        s.step({a: 9, b: 3})
        f = s.fork(a)
        s.step({a: 1, b: 2, f: 1})
        s.step({a: 2, b: 1, f: 3})
        got[backend], pools[backend] = s, s.srv.pool
    s = got["cuda"]
    assert isinstance(pools["cuda"].arrays[0], arrays.CacheCodes)
    for mine, theirs in zip(pools["cuda"].host_arrays(), pools["interp"].host_arrays()):
        assert mine.dtype == theirs.dtype
        np.testing.assert_array_equal(mine.view(np.uint8), theirs.view(np.uint8))
    for seq, last in ((a, 3), (b, 3), (f, 4)):
        q, keys, values, out = s.whole(seq, last)
        want = ac.interpret(causal_gqa, q, keys, values)[:, :, -last:]
        assert relative(out, want) < 2e-5, f"sequence {seq}"
    with pytest.raises(ValueError, match=r"^cache: an 8-bit cache type is one of f8e4m3, f8e5m2"):
        compiled["cuda"].paged_decoder(page_size=8, num_pages=4, cache="e4m3")
