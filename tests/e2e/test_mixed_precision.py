"""Mixed precision as specs write it (docs/ir.md, "Weak scalars" and "The attention's types").

A Python float never widens a spec: the ALiBi slope ``exp((h + 1) * -1.386)`` is float32 in a
float32 spec, and in a 16-bit call it meets the scores in their type.  Float32 parameters (slopes,
a bias table, a temperature) in a bf16 or f16 attention widen the graph's scores, but the fused op
computes its scores in float32 anyway and returns the values' type, so every case fuses and the
call returns what it was given.  Each is checked against the float64 interpreter on the same,
rounded, inputs, at the call type's tolerance.
"""

import ml_dtypes
import numpy as np
import pytest

import attncomp as ac
from attncomp.hf.specs import with_sinks
from attncomp.testing import TOLERANCE, worst_error
from benchmarks.specs import causal_alibi_f32_slopes as alibi_f32_slopes  # the spec benchmarks.float_types times

BF16 = ml_dtypes.bfloat16
NUMPY = {"f16": np.float16, "bf16": BF16, "f32": np.float32, "f64": np.float64}
B, H, T, D = 1, 2, 24, 16


def constant_slope_body(q, k, v):
    s = (q @ k.mT) * q.shape[-1] ** -0.5
    b, h, i, j = ac.index(s)
    slope = ac.exp((h + 1) * -1.386)  # a Python float times the head index
    s = ac.where(j <= i, s + slope * (j - i), -ac.inf)
    return ac.softmax(s, axis=-1) @ v


def constant_slope_spec(dtype: str) -> ac.Spec:
    """The constant-slope ALiBi with q, k and v declared ``dtype`` (``floating``: generic)."""
    t = getattr(ac, dtype)

    def alibi_constant_slope(q: t["B", "H", "T", "D"], k: t["B", "H", "S", "D"], v: t["B", "H", "S", "D"]):
        return constant_slope_body(q, k, v)

    return ac.spec(alibi_constant_slope)


@ac.spec
def relative_bias_f32(
    q: ac.floating["B", "H", "T", "D"],
    k: ac.floating["B", "H", "S", "D"],
    v: ac.floating["B", "H", "S", "D"],
    table: ac.f32["H", "R"],
    *,
    max_distance: int = 8,
):
    s = (q @ k.mT) * q.shape[-1] ** -0.5
    b, h, i, j = ac.index(s)
    distance = ac.minimum(ac.maximum(i - j, -max_distance), max_distance)
    return ac.softmax(s + table[h, distance + max_distance], axis=-1) @ v


@ac.spec
def softcap_f32_temperature(
    q: ac.floating["B", "H", "T", "D"],
    k: ac.floating["B", "H", "S", "D"],
    v: ac.floating["B", "H", "S", "D"],
    cap: ac.f32["H"],
):
    s = (q @ k.mT) * q.shape[-1] ** -0.5
    b, h, i, j = ac.index(s)
    s = cap[h] * ac.tanh(s / cap[h])
    return ac.softmax(ac.where(j <= i, s, -ac.inf), axis=-1) @ v


@ac.spec
def sinks_f32_logits(
    q: ac.floating["B", "H", "T", "D"],
    k: ac.floating["B", "H", "S", "D"],
    v: ac.floating["B", "H", "S", "D"],
    sinks: ac.f32["H"],
):
    s = (q @ k.mT) * q.shape[-1] ** -0.5
    b, h, i, j = ac.index(s)
    s = ac.where(j <= i, s, -ac.inf)
    out = ac.softmax(s, axis=-1) @ v
    # the float32 renormalisation widens the product (a declared tensor does); the spec keeps the values' type
    return with_sinks(out, s, sinks).astype(out.dtype)


def parameter(spec: ac.Spec, rng: np.random.Generator) -> list[np.ndarray]:
    """The float32 parameter each spec captures."""
    if spec is alibi_f32_slopes:
        return [np.array([0.5, 0.0625], np.float32)]
    if spec is relative_bias_f32:
        return [rng.standard_normal((H, 17)).astype(np.float32)]
    if spec is softcap_f32_temperature:
        return [np.array([2.0, 30.0], np.float32)]
    if spec is sinks_f32_logits:
        return [np.array([0.5, -1.0], np.float32)]
    return []


def inputs_for(spec: ac.Spec, dtype: str, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    qkv = [(rng.standard_normal((B, H, T, D)) * 2).astype(NUMPY[dtype]) for _ in range(3)]
    return qkv + parameter(spec, rng)


PARAMETER_SPECS = [alibi_f32_slopes, relative_bias_f32, softcap_f32_temperature, sinks_f32_logits]
SPEC_IDS = ["alibi", "relative_bias", "softcap", "sinks"]


def exact(spec: ac.Spec, dtype: str, inputs: list[np.ndarray]) -> list[np.ndarray]:
    """The float64 interpreter on the inputs as rounded to their types."""
    fn = ac.compile(spec, backend="interp")
    result = fn.for_dtype(dtype if fn.generic else None).compilation.run(inputs, exact=True)
    return list(result)


def assert_fused(fn: ac.CompiledFunction, dtype: str) -> None:
    member = fn.for_dtype(dtype if fn.generic else None)
    assert not [r for r in member.remarks if "not fused" in r], member.remarks
    assert member.ir("softmax-fusion").count("ac.attention ") == 1
    assert "ac.softmax" not in member.ir("softmax-fusion")


def test_a_python_float_does_not_widen_a_float32_spec():
    spec = constant_slope_spec("f32")
    text = str(spec.ir)
    assert "f64" not in text
    assert "ac.constant {value = -1.386} : tensor<f32>" in text
    fn = ac.compile(spec, backend="cpu")
    inputs = inputs_for(spec, "f32")
    out = fn(*inputs)
    assert out.dtype == np.float32
    assert_fused(fn, "f32")
    assert worst_error([out], exact(spec, "f32", inputs)) < TOLERANCE["f32"]


@pytest.mark.parametrize("dtype", ["f16", "bf16", "floating"])
def test_a_python_float_takes_the_type_it_meets(dtype):
    spec = constant_slope_spec(dtype)
    call = "bf16" if dtype == "floating" else dtype
    # traced in float32, the slope term meets the 16-bit scores in their type
    text = str(spec.ir if dtype != "floating" else spec.trace_as(call))
    assert "f64" not in text
    assert f"-> tensor<B x H x T x D x {call}>" in text
    runs_fused(spec, call)


def runs_fused(spec, dtype: str) -> None:
    """``spec`` called in ``dtype`` on the interpreter: one fused attention, the result in ``dtype``
    and within its tolerance of float64."""
    fn = ac.compile(spec, backend="interp")
    inputs = inputs_for(spec, dtype)
    out = fn(*inputs)
    assert out.dtype == NUMPY[dtype]
    assert_fused(fn, dtype)
    assert worst_error([out], exact(spec, dtype, inputs)) < TOLERANCE[dtype]


def test_the_fused_op_shows_its_score_type():
    fn = ac.compile(alibi_f32_slopes, backend="interp")
    text = fn.ir("softmax-fusion", dtype="bf16")
    assert "%out = ac.attention %q, %k, %v {kv_repeat = 1, with_lse = false} : tensor<B x H x T x D x bf16>" in text
    # the score region computes in float32, reading the float32 slopes as they are
    assert "%s: tensor<f32>" in text
    assert "ac.gather %slopes, %h : tensor<f32>" in text


def test_scores_widened_past_the_score_type_say_so():
    @ac.spec
    def f64_bias(q: ac.f32["T", "D"], k: ac.f32["S", "D"], v: ac.f32["S", "D"], bias: ac.f64["T", "S"]):
        return ac.softmax(q @ k.mT + bias, axis=-1) @ v

    fn = ac.compile(f64_bias, backend="interp")
    assert fn.module.main.results[0].type.dtype == "f32"  # the values' type, not the bias's
    assert any("wider than the attention's score type f32" in r for r in fn.remarks), fn.remarks
    assert_fused(fn, "f32")


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
@pytest.mark.parametrize("spec", PARAMETER_SPECS, ids=SPEC_IDS)
def test_float32_parameters_fuse_in_16_bits(spec, dtype):
    runs_fused(spec, dtype)


CONSTANT_SLOPE = constant_slope_spec("floating")
EVERY_SPEC = [*PARAMETER_SPECS, CONSTANT_SLOPE]
EVERY_ID = [*SPEC_IDS, "constant_slope"]
_CPU: dict[str, ac.CompiledFunction] = {}


def on_cpu(spec: ac.Spec) -> ac.CompiledFunction:
    """One cpu compilation per spec for the whole module (each float type compiled once in it)."""
    if spec.name not in _CPU:
        _CPU[spec.name] = ac.compile(spec, backend="cpu")
    return _CPU[spec.name]


@pytest.mark.parametrize("spec", EVERY_SPEC, ids=EVERY_ID)
def test_bf16_on_the_cpu_with_gradients(spec):
    """Forward in bf16, and gradients: bf16 for the bf16 inputs, float32 for the float32 parameter,
    following the float32 call's gradients."""
    fn = on_cpu(spec)
    inputs = inputs_for(spec, "bf16")
    out, pullback = fn.vjp(*inputs)
    assert out.dtype == BF16
    assert_fused(fn, "bf16")
    assert worst_error([out], exact(spec, "bf16", inputs)) < TOLERANCE["bf16"]
    cotangent = np.random.default_rng(1).standard_normal(out.shape).astype(BF16)
    grads = pullback(cotangent)
    assert [g.dtype for g in grads] == [x.dtype for x in inputs]
    widened = [x.astype(np.float32) for x in inputs]
    _, pullback32 = fn.vjp(*widened)
    want = pullback32(cotangent.astype(np.float32))
    assert worst_error(grads, want) < TOLERANCE["bf16"]


@pytest.mark.parametrize("spec", EVERY_SPEC, ids=EVERY_ID)
def test_f16_on_the_cpu(spec):
    fn = on_cpu(spec)
    inputs = inputs_for(spec, "f16")
    out = fn(*inputs)
    assert out.dtype == np.float16
    assert_fused(fn, "f16")
    assert worst_error([out], exact(spec, "f16", inputs)) < TOLERANCE["f16"]


#: the causal specs: a decoder's step sees the keys so far, so a bidirectional spec (the bias table's)
#: decodes to something else in every float type
CAUSAL = [(spec, name) for spec, name in zip(EVERY_SPEC, EVERY_ID) if spec is not relative_bias_f32]


@pytest.mark.parametrize("spec", [spec for spec, _ in CAUSAL], ids=[name for _, name in CAUSAL])
def test_a_bf16_decoder(spec):
    fn = on_cpu(spec)
    inputs = inputs_for(spec, "bf16")
    dec = fn.decoder(32)
    steps = [(0, 10), (10, 11), (11, T)]
    outs = [dec(*(x[:, :, a:b] for x in inputs[:3]), *inputs[3:]) for a, b in steps]
    got = np.concatenate(outs, axis=2)
    assert got.dtype == BF16
    assert worst_error([got], exact(spec, "bf16", inputs)) < TOLERANCE["bf16"]


def test_a_bf16_paged_pool_with_float32_slopes():
    fn = on_cpu(alibi_f32_slopes)
    inputs = inputs_for(alibi_f32_slopes, "bf16")
    server = fn.paged_decoder(page_size=8, num_pages=8, dtype="bf16")
    seq = server.new()
    outs = [server.step({seq: (*(x[:, :, a:b] for x in inputs[:3]), inputs[3])})[seq] for a, b in [(0, 9), (9, T)]]
    got = np.concatenate(outs, axis=2)
    assert got.dtype == BF16
    assert worst_error([got], exact(alibi_f32_slopes, "bf16", inputs)) < TOLERANCE["bf16"]


@pytest.mark.parametrize("spec", EVERY_SPEC, ids=EVERY_ID)
def test_the_torch_op_under_autocast(spec):
    """float32 tensors under ``torch.autocast`` to bf16: the ac.floating arguments run in bf16, the
    float32 parameter stays float32 (and gets a float32 gradient), the result is bf16."""
    torch = pytest.importorskip("torch")
    op = on_cpu(spec).to_torch()
    base = [torch.from_numpy(x) for x in inputs_for(spec, "f32")]
    want = op(*base)
    leaves = [x.clone().requires_grad_() for x in base]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = op(*leaves)
    assert out.dtype == torch.bfloat16
    assert worst_error([out.float().detach().numpy()], [want.detach().numpy()]) < TOLERANCE["bf16"]
    out.float().sum().backward()
    assert all(x.grad.dtype == torch.float32 for x in leaves)
    args = [x.to(torch.bfloat16) for x in base[:3]] + base[3:]
    torch.library.opcheck(op.op, tuple(args))


def test_a_generic_spec_with_float32_slopes_over_dask():
    da = pytest.importorskip("dask.array")
    fn = on_cpu(alibi_f32_slopes)
    inputs = inputs_for(alibi_f32_slopes, "bf16")
    chunked = [da.from_array(x, chunks=(1, 2, 8, D)) for x in inputs[:3]]
    got = fn(*chunked, inputs[3]).compute()
    assert got.dtype == BF16
    assert worst_error([got], exact(alibi_f32_slopes, "bf16", inputs)) < TOLERANCE["bf16"]
