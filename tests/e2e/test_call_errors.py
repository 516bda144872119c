"""Calling compiled functions and the interpreter: argument checks, shapes, dtypes, traces, constants."""

# Dimension names in annotations (ac.f32["T", "D"]) are not forward references.
# ruff: noqa: F821, UP037

import re

import numpy as np
import pytest

import attncomp as ac


@ac.spec
def windowed(
    q: ac.f32["B", "H", "T", "D"],
    k: ac.f32["B", "H", "S", "D"],
    v: ac.f32["B", "H", "S", "E"],
    *,
    window: int = 100,
):
    s = (q @ k.mT) * q.shape[-1] ** -0.5
    b, h, i, j = ac.index(s)
    s = ac.where((j <= i) & (i - j < window), s, -ac.inf)
    return ac.softmax(s, axis=-1) @ v, ac.logsumexp(s, axis=-1)


def np_windowed(q, k, v, window=100):
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    i, j = np.arange(q.shape[2])[:, None], np.arange(k.shape[2])[None, :]
    s = np.where((j <= i) & (i - j < window), s, -np.inf)
    m = s.max(-1, keepdims=True)
    e = np.exp(s - m)
    return e @ v / e.sum(-1, keepdims=True), np.log(e.sum(-1)) + m[..., 0]


@ac.spec
def gqa(q: ac.f32["B", "H", "T", "D"], k: ac.f32["B", "KV", "S", "D"]):
    kr = ac.repeat_kv(k, q.shape[1] // k.shape[1])
    return q @ kr.mT


@ac.spec
def fixed(x: ac.f32["T", 4]):
    return x * 2


@ac.spec
def ints(a: ac.i64["N"], x: ac.f16["N"]):
    return a * 2, x + 1.0, a > 0


def qkv(rng, B=1, H=2, T=4, S=5, D=8, E=3, dtype=np.float32):
    return (
        rng.standard_normal((B, H, T, D)).astype(dtype),
        rng.standard_normal((B, H, S, D)).astype(dtype),
        rng.standard_normal((B, H, S, E)).astype(dtype),
    )


@pytest.fixture(scope="module")
def fn():
    return ac.compile(windowed, backend="interp")


def both(fn):
    """The compiled function and the interpreter: every argument check applies to both."""
    return [fn, lambda *args: ac.interpret(windowed, *args)]


# argument checks ------------------------------------------------------------------------------
def test_wrong_number_of_arguments(fn, rng):
    q, k, v = qkv(rng)
    for call in both(fn):
        with pytest.raises(TypeError, match=r"^@windowed takes 3 arguments \(q, k, v\), got 2$"):
            call(q, k)
        with pytest.raises(TypeError, match=r"^@windowed takes 3 arguments \(q, k, v\), got 4$"):
            call(q, k, v, v)


def test_wrong_rank(fn, rng):
    q, k, v = qkv(rng)
    for call in both(fn):
        with pytest.raises(ac.ShapeError) as info:
            call(q, k[0], v)
        assert str(info.value) == "k: expected rank 4 (B, H, S, D), got rank 3 with shape (2, 5, 8)"


def test_shape_error_is_a_value_error():
    assert issubclass(ac.ShapeError, ValueError)


def test_wrong_dtype(fn, rng):
    q, k, v = qkv(rng)
    for call in both(fn):
        with pytest.raises(TypeError, match=r"^q: expected f32 \(float32\) elements, got float64$"):
            call(q.astype(np.float64), k, v)
        with pytest.raises(TypeError, match=r"^v: expected f32 \(float32\) elements, got int32$"):
            call(q, k, v.astype(np.int32))
        with pytest.raises(TypeError, match=r"^k: expected f32 \(float32\) elements, got bool$"):
            call(q, k > 0, v)


def test_narrower_dtypes_of_the_same_kind_are_accepted(rng):
    a, x = np.arange(-2, 3, dtype=np.int32), np.linspace(-1, 1, 5).astype(np.float16)
    got = ac.compile(ints, backend="interp")(a, x)
    np.testing.assert_array_equal(got[0], a * 2)
    q, k, v = qkv(rng)
    out, _ = ac.interpret(windowed, q.astype(np.float16), k, v)
    np.testing.assert_allclose(out, np_windowed(q.astype(np.float16), k, v)[0], rtol=1e-12)


def test_wider_int_for_a_narrower_one_is_rejected():
    @ac.spec
    def narrow(a: ac.i32["N"]):
        return a + 1

    with pytest.raises(TypeError, match=r"^a: expected i32 \(int32\) elements, got int64$"):
        ac.interpret(narrow, np.arange(3, dtype=np.int64))


def test_not_an_array(fn, rng):
    q, k, v = qkv(rng)
    with pytest.raises(TypeError, match=r"^q: expected an array, got str$"):
        fn("q", k, v)


def test_mismatched_sizes(fn, rng):
    q, _, v = qkv(rng, D=64)
    _, k, _ = qkv(rng, D=32)
    for call in both(fn):
        with pytest.raises(ac.ShapeError) as info:
            call(q, k, v)
        assert str(info.value) == "k: dimension D is 32, but q gave D = 64"


def test_mismatched_batch(fn, rng):
    q, k, v = qkv(rng)
    with pytest.raises(ac.ShapeError) as info:
        fn(q, k, np.concatenate([v, v]))
    assert str(info.value) == "v: dimension B is 2, but q gave B = 1"


def test_fixed_size_mismatch(rng):
    x = rng.standard_normal((3, 5)).astype(np.float32)
    for call in [ac.compile(fixed, backend="interp"), lambda x: ac.interpret(fixed, x)]:
        with pytest.raises(ac.ShapeError) as info:
            call(x)
        assert str(info.value) == "x: dimension 1 must be 4, got 5"


def test_gqa_constraint(rng):
    q = rng.standard_normal((1, 8, 2, 4)).astype(np.float32)
    k = rng.standard_normal((1, 2, 3, 4)).astype(np.float32)
    want = q.astype(np.float64) @ np.swapaxes(np.repeat(k, 4, axis=1), -1, -2).astype(np.float64)
    np.testing.assert_allclose(ac.interpret(gqa, q, k), want, rtol=1e-12)
    fn = ac.compile(gqa, backend="interp")
    bad_k = rng.standard_normal((1, 3, 3, 4)).astype(np.float32)
    message = "sizes H = 8, KV = 3 do not fit the spec: H = 8 but (KV*(H//KV)) = 6 (ac.matmul batch axes)"
    for call in [fn, lambda *a: ac.interpret(gqa, *a)]:
        with pytest.raises(ac.ShapeError) as info:
            call(q, bad_k)
        assert str(info.value) == message


def test_gqa_with_no_key_heads(rng):
    q = np.ones((1, 8, 2, 4), np.float32)
    with pytest.raises(ac.ShapeError) as info:
        ac.interpret(gqa, q, np.ones((1, 0, 3, 4), np.float32))
    assert str(info.value) == "sizes H = 8, KV = 0 divide by zero in (KV*(H//KV)) (ac.matmul batch axes)"


# results -----------------------------------------------------------------------------------------
def test_shape_generic(fn, rng):
    for sizes in [dict(B=1, H=2, T=4, S=5, D=8, E=3), dict(B=2, H=1, T=7, S=3, D=2, E=6)]:
        q, k, v = qkv(rng, **sizes)
        out, lse = fn(q, k, v)
        want_out, want_lse = np_windowed(q, k, v)
        assert out.shape == (sizes["B"], sizes["H"], sizes["T"], sizes["E"])
        np.testing.assert_allclose(out, want_out, rtol=2e-5, atol=1e-6)
        np.testing.assert_allclose(lse, want_lse, rtol=2e-5, atol=1e-6)
    assert fn.stages == ac.compile(windowed, backend="interp").stages


def test_inputs_are_not_modified(fn, rng):
    args = qkv(rng)
    before = [a.tobytes() for a in args]
    fn(*args)
    ac.interpret(windowed, *args)
    ac.interpret(windowed, *args, trace=True)
    assert [a.tobytes() for a in args] == before


def test_outputs_have_the_declared_dtype(fn, rng):
    out, lse = fn(*qkv(rng))
    assert out.dtype == np.float32 and lse.dtype == np.float32
    a, x = np.arange(-2, 3), np.linspace(-1, 1, 5).astype(np.float16)
    doubled, shifted, positive = ac.compile(ints, backend="interp")(a, x)
    assert (doubled.dtype, shifted.dtype, positive.dtype) == (np.int64, np.float16, np.bool_)
    np.testing.assert_array_equal(positive, a > 0)


def test_the_interpreter_computes_in_float64(rng):
    out, lse = ac.interpret(windowed, *qkv(rng))
    assert out.dtype == np.float64 and lse.dtype == np.float64
    doubled, shifted, positive = ac.interpret(ints, np.arange(3), np.ones(3, np.float16))
    assert (doubled.dtype, shifted.dtype, positive.dtype) == (np.int64, np.float64, np.bool_)


def test_multiple_outputs_are_a_tuple(fn, rng):
    q, k, v = qkv(rng)
    for result in [fn(q, k, v), ac.interpret(windowed, q, k, v)]:
        assert isinstance(result, tuple) and len(result) == 2
        for got, want in zip(result, np_windowed(q, k, v)):
            np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)


def test_single_output_is_an_array(rng):
    x = rng.standard_normal((3, 4)).astype(np.float32)
    assert isinstance(ac.compile(fixed, backend="interp")(x), np.ndarray)
    assert isinstance(ac.interpret(fixed, x), np.ndarray)


def test_trace_gives_every_value_named_as_in_the_printed_ir(rng):
    q, k, v = qkv(rng)
    (out, lse), values = ac.interpret(windowed, q, k, v, trace=True)
    text = str(windowed.ir)
    header, *body = text.splitlines()
    args = re.findall(r"%(\w+):", header)
    results = [name for line in body for name in re.findall(r"%(\w+)", line.split(" = ")[0]) if " = " in line]
    assert args == ["q", "k", "v"]
    assert list(values) == args + results
    assert {"s", "s_1", "i", "j"} <= set(values)
    np.testing.assert_array_equal(values["q"], q.astype(np.float64))
    np.testing.assert_array_equal(values["i"], np.arange(4).reshape(1, 1, 4, 1))
    s = q.astype(np.float64) @ np.swapaxes(k, -1, -2).astype(np.float64) / np.sqrt(8)
    np.testing.assert_allclose(values["s"], s, rtol=1e-12)
    # the returned values are the last ones traced
    last = re.findall(r"%(\w+)", body[-2])[-2:]
    np.testing.assert_array_equal(values[last[0]], out)
    np.testing.assert_array_equal(values[last[1]], lse)


def test_interpret_takes_ir_modules_and_text(rng):
    q, k, v = qkv(rng)
    want = ac.interpret(windowed, q, k, v)
    for target in [windowed.ir, str(windowed.ir), ac.parse_ir(str(windowed.ir))]:
        for got, w in zip(ac.interpret(target, q, k, v), want):
            np.testing.assert_array_equal(got, w)
    with pytest.raises(TypeError, match="^constants can only be given with a spec, not with IR$"):
        ac.interpret(windowed.ir, q, k, v, window=2)


# compile options -------------------------------------------------------------------------------
def test_unknown_backend():
    with pytest.raises(ValueError, match=r"^unknown backend 'tpu'; available backends: .*interp"):
        ac.compile(windowed, backend="tpu")


def test_unknown_constant():
    message = r"^windowed: unknown constant\(s\) wndow; valid: window$"
    with pytest.raises(TypeError, match=message):
        ac.compile(windowed, backend="interp", wndow=3)
    with pytest.raises(TypeError, match=message):
        ac.interpret(windowed, *qkv(np.random.default_rng(0)), wndow=3)
    with pytest.raises(TypeError, match=r"^fixed: unknown constant\(s\) window; valid: none$"):
        ac.compile(fixed, backend="interp", window=3)


def test_constants_override_the_defaults(fn, rng):
    q, k, v = qkv(rng, T=6, S=6)
    narrow = ac.compile(windowed, backend="interp", window=2)
    assert "attributes {window = 2}" in narrow.ir("input")
    assert "attributes {window = 100}" in fn.ir("input")
    got, want = narrow(q, k, v), np_windowed(q, k, v, window=2)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=1e-6)
    assert not np.allclose(got[0], fn(q, k, v)[0])
    for g, w in zip(ac.interpret(windowed, q, k, v, window=2), want):
        np.testing.assert_allclose(g, w, rtol=1e-12)
    # the spec's own IR keeps its defaults
    assert "attributes {window = 100}" in str(windowed.ir)


@ac.spec
def fixed_slice(x: ac.f32["N", "M"]):
    return x[:, 4:8] * 2.0


def test_a_slice_past_the_end_is_a_shape_error():
    with pytest.raises(ac.ShapeError, match=r"sizes M = 6 do not fit the spec: 8 exceeds M = 6 \(ac.slice: stop 8"):
        ac.interpret(fixed_slice, np.ones((2, 6), np.float32))
    assert ac.interpret(fixed_slice, np.ones((2, 9), np.float32)).shape == (2, 4)
