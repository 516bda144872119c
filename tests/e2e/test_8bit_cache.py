"""8-bit key/value caches (``fn.decoder(max_len, cache="f8e4m3")``): codes and a float32 scale per
(token, head), quantised on append, dequantised as tiles are read.  Decoded steps agree with the
float64 interpreter run on the dequantised cache at float32's tolerance, and their error against
the unquantised result stays within what the type's rounding allows."""

# ruff: noqa: F821

import ml_dtypes
import numpy as np
import pytest

import attncomp as ac
from attncomp.ir.quantized import CACHE_MAX, dequantize, quantize
from attncomp.ir.types import NUMPY_DTYPES

#: half an ulp of each type relative to a value (3 and 2 mantissa bits), and half its smallest step
ROUNDING = {"f8e4m3": 2.0**-4, "f8e5m2": 2.0**-3}
SMALLEST_HALF_STEP = {"f8e4m3": 2.0**-10, "f8e5m2": 2.0**-17}


@ac.spec
def causal_gqa(
    q: ac.floating["B", "H", "T", "D"], k: ac.floating["B", "KV", "T", "D"], v: ac.floating["B", "KV", "T", "D"]
):
    n_rep = q.shape[1] // k.shape[1]
    s = (q @ ac.repeat_kv(k, n_rep).mT) * q.shape[-1] ** -0.5
    b, h, i, j = ac.index(s)
    return ac.softmax(ac.where(j <= i, s, -ac.inf), axis=-1) @ ac.repeat_kv(v, n_rep)


@pytest.fixture(scope="module")
def compiled():
    return {backend: ac.compile(causal_gqa, backend=backend) for backend in ("interp", "cpu")}


def decode(fn, cache, q, k, v, cuts, dtype="f32"):
    """Prefill up to ``cuts[0]``, then steps between the cuts: the outputs and the decoder."""
    dec = fn.decoder(max_len=q.shape[2] + 3, dtype=dtype, cache=cache)
    outs = [dec(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b]) for a, b in zip([0, *cuts], cuts)]
    return np.concatenate(outs, axis=2).astype(np.float64), dec


def dequantized(dec):
    c = dec.cache
    return dequantize(c["k_cache"], c["k_scale"]), dequantize(c["v_cache"], c["v_scale"])


def relative(got, want):
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


@pytest.mark.parametrize("backend", ["interp", "cpu"])
@pytest.mark.parametrize("cache", ["f8e4m3", "f8e5m2"])
@pytest.mark.parametrize(("group", "d"), [(4, 32), (3, 24)])
def test_decode_steps_agree_with_the_interpreter_on_the_dequantised_cache(compiled, backend, cache, group, d):
    """A prefill of 150 tokens (the tile path of many rows), single tokens (the few-row loops: four
    rows at a time over codes, on the vector loops where D is a multiple of 16), and a step of 5."""
    rng = np.random.default_rng(group * d)
    kv, n = 2, 160
    q = rng.standard_normal((1, kv * group, n, d)).astype(np.float32)
    k, v = (rng.standard_normal((1, kv, n, d)).astype(np.float32) * 3 for _ in range(2))
    got, dec = decode(compiled[backend], cache, q, k, v, [150, 151, 152, 153, 158, 159, 160])
    assert dec.cache["k_cache"].dtype == np.dtype(NUMPY_DTYPES[cache])
    assert dec.cache["k_scale"].shape == (1, kv, n) and dec.cache["k_scale"].dtype == np.float32
    assert dec.cache["v_cache"].shape == (1, kv, n, d)
    k_read, v_read = dequantized(dec)
    want = ac.interpret(causal_gqa, q, k_read, v_read)
    assert relative(got, want) < 2e-5
    exact = ac.interpret(causal_gqa, q, k, v)
    assert 1e-4 < relative(got, exact)  # the cache was quantised


@pytest.mark.parametrize("cache", ["f8e4m3", "f8e5m2"])
def test_quantising_rounds_to_nearest_per_token_and_head_and_saturates(cache):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((2, 3, 40, 16)) * rng.uniform(0.01, 100, (2, 3, 40, 1))).astype(np.float32)
    x[0, 0, 0] = 0.0  # a row of zeros: scale 0, codes 0
    codes, scales = quantize(x, cache)
    top = CACHE_MAX[cache]
    np.testing.assert_array_equal(scales, (np.max(np.abs(x), axis=-1) / np.float32(top)).astype(np.float32))
    assert scales[0, 0, 0] == 0 and not np.any(codes[0, 0, 0].astype(np.float32))
    back = dequantize(codes, scales).astype(np.float64)
    bound = ROUNDING[cache] * np.abs(x) + SMALLEST_HALF_STEP[cache] * scales[..., None] * 1.0001
    assert np.all(np.abs(back - x) <= bound)
    # each row's largest magnitude is the type's largest value (to rounding of the scale)
    assert np.all(np.abs(np.max(np.abs(codes.astype(np.float32)), axis=-1)[scales > 0] - top) <= top * 2**-4)
    # nearest: within half a step of the type around each value (the codes' own units)
    ratio = x / np.where(scales > 0, scales, np.float32(1.0))[..., None]
    wanted = np.clip(ratio, -top, top)
    assert np.all(
        np.abs(codes.astype(np.float64) - wanted) <= ROUNDING[cache] * np.abs(wanted) + SMALLEST_HALF_STEP[cache]
    )
    # saturating: a value past the largest (the scale rounded down) gives the largest code, never NaN
    saturated, _ = quantize(np.array([[1.0, 1e-3]], np.float32), cache)
    assert saturated.astype(np.float32)[0, 0] == top


@pytest.mark.parametrize("cache", ["f8e4m3", "f8e5m2"])
def test_the_cpu_append_quantises_as_numpy_does(cache):
    """``runtime.cache_append_quantized``, compiled (``numba_cpu/quantize.py``), writes the codes and
    scales of ``quantize`` bit for bit: magnitudes from 1e-8 to 1e8, subnormal codes, every tie
    between two codes (rounded to even), rows of zeros, with a NaN and with an infinity."""
    from attncomp.backends.numba_cpu.runtime import cache_append_quantized

    rng = np.random.default_rng(5)
    rows = (rng.standard_normal((96, 16)) * 10.0 ** rng.uniform(-8, 8, (96, 1))).astype(np.float32)
    rows[:, 1:4] *= np.float32(1e-4)  # small beside the row's largest: subnormal codes
    values = np.arange(256, dtype=np.uint8).view(NUMPY_DTYPES[cache]).astype(np.float64)
    finite = np.unique(np.abs(values[np.isfinite(values)]))
    ties = ((finite[:-1] + finite[1:]) / 2).astype(np.float32)  # exact in float32
    top = np.float32(CACHE_MAX[cache])
    tied = np.zeros((-(-len(ties) // 15), 16), np.float32)
    tied[:, 0] = top  # each row's scale is 1: its entries are the codes' own values
    tied[:, 1:].flat[: len(ties)] = ties * np.where(np.arange(len(ties)) % 2, 1, -1)
    rows = np.concatenate([rows, tied, tied[: len(tied) % 2]])  # an even count: two heads
    rows[0] = 0.0
    rows[1, 5] = np.nan
    rows[2, 7] = np.inf
    new = rows.reshape(1, 2, -1, 16)
    stored = np.zeros((1, 2, new.shape[2] + 5, 16), NUMPY_DTYPES[cache])
    scales = np.full(stored.shape[:-1], -1.0, np.float32)
    cache_append_quantized(stored, scales, new, 2, 3)
    codes, want_scales = quantize(new, cache)
    assert np.array_equal(stored[:, :, 3:-2].view(np.uint8), codes.view(np.uint8))
    assert np.array_equal(scales[:, :, 3:-2], want_scales, equal_nan=True)
    assert np.all(scales[:, :, :3] == -1) and np.all(scales[:, :, -2:] == -1)  # nothing else written


@pytest.mark.parametrize("cache", ["f8e4m3", "f8e5m2"])
def test_the_error_against_the_unquantised_result_is_bounded_by_the_type(compiled, cache):
    """Per query row: values dequantised within ``u`` of their size, scores moved by at most
    ``u |q| |k_j| / sqrt(D)``, so the output moves by at most ``max|v| (u + 2 max_j |ds_j|)``
    (``u`` half an ulp: 2**-4 for f8e4m3, 2**-3 for f8e5m2), to first order."""
    rng = np.random.default_rng(2)
    kv, group, n, d = 2, 4, 130, 32
    q = rng.standard_normal((1, kv * group, n, d)).astype(np.float32)
    k, v = (rng.standard_normal((1, kv, n, d)).astype(np.float32) for _ in range(2))
    got, _ = decode(compiled["cpu"], cache, q, k, v, [100, *range(101, n + 1)])
    exact = ac.interpret(causal_gqa, q, k, v).astype(np.float64)
    u = ROUNDING[cache]
    q_norm = np.linalg.norm(q[0], axis=-1)  # [H, T]
    k_norm = np.repeat(np.linalg.norm(k[0], axis=-1), group, axis=0)  # [H, T]
    causal_max = np.maximum.accumulate(k_norm, axis=-1)  # the largest key each row sees
    score_moves = u * q_norm * causal_max / np.sqrt(d)
    v_max = np.max(np.abs(v))
    bound = v_max * (u + 2 * score_moves) * 1.1
    error = np.max(np.abs(got - exact)[0], axis=-1)
    assert np.all(error <= bound)
    print(f"{cache}: largest error {relative(got, exact):.2e} of the largest output")


@pytest.mark.parametrize(("cache", "d"), [("f8e4m3", 32), ("f8e4m3", 128), ("f8e5m2", 96)])
def test_bf16_inputs_with_an_8bit_cache_on_the_cpu(compiled, cache, d):
    """bf16 steps: on a CPU with AVX-512 BF16 and VBMI the codes meet the queries and the weights
    (rounded to bf16) on bf16 dot products (``code_loops``), in chunks of 64 codes and 32."""
    rng = np.random.default_rng(3)
    q = rng.standard_normal((1, 8, 70, d)).astype(ml_dtypes.bfloat16)
    k, v = (rng.standard_normal((1, 2, 70, d)).astype(ml_dtypes.bfloat16) for _ in range(2))
    got, dec = decode(compiled["cpu"], cache, q, k, v, [64, 65, 66, 70], dtype="bf16")
    assert dec(q[:, :, :1], k[:, :, :1], v[:, :, :1]).dtype == ml_dtypes.bfloat16
    k_read, v_read = (x.astype(ml_dtypes.bfloat16) for x in dequantized(dec))
    want = ac.interpret(causal_gqa, q, k_read[:, :, :70], v_read[:, :, :70]).astype(np.float64)
    assert relative(got, want) < 1e-2  # bf16: the result's rounding, and the reference's rounded cache


def test_the_cache_type_is_in_the_ir_and_the_pipeline(compiled):
    dec = compiled["cpu"].decoder(max_len=16, dtype="f32", cache=ac.f8e5m2)
    text = dec.fn.ir("kv-cache-reuse")
    assert 'cache_type = "f8e5m2"' in text
    assert "%k_cache: tensor<B x KV x N_max x D x f8e5m2>, %k_scale: tensor<B x KV x N_max x f32>" in text
    assert "ac.cache_append %k_cache, %k_scale, %k {axis = 2, length = N_cached}" in text
    assert "kv-cache-reuse{cache=f8e5m2}" in dec.fn.pipeline
    assert str(ac.parse_ir(text)) == text
    assert "scale_keys(sg, " in dec.fn.source and "dequantize_rows(" in dec.fn.source


def test_bad_cache_types_are_refused_naming_the_argument(compiled):
    fn = compiled["cpu"]
    for bad in ("f8", "bf16", ac.f32, 8):
        with pytest.raises(ValueError, match=r"^cache: an 8-bit cache type is one of f8e4m3, f8e5m2"):
            fn.decoder(max_len=8, cache=bad)
    with pytest.raises(ac.PipelineError, match="kv-cache-reuse: cache must be one of f8e4m3, f8e5m2"):
        ac.compile(causal_gqa, backend="interp", pipeline="softmax-fusion,kv-cache-reuse{cache=i8}")
    with pytest.raises(ac.SpecError, match="argument 'k': ac.f8e4m3 is the element type of an 8-bit key/value cache"):

        @ac.spec
        def stored(q: ac.f32["T", "D"], k: ac.f8e4m3["T", "D"]):
            return q @ k.mT
