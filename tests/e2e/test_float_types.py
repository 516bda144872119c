"""bf16, and one spec for every float type (docs/api.md section 9).

Every check compares a run on 16-bit inputs with the float64 interpreter on the same, rounded,
inputs: the bound is the type's (``testing.TOLERANCE``), the error being the final rounding
and what kernels computing in float32 add to it.
"""

import inspect
import types

import ml_dtypes
import numpy as np
import pytest
from conftest import example_names, load_example

import attncomp as ac
from attncomp.dsl import GENERIC, Spec, TensorSpec
from attncomp.ir.core import Module
from attncomp.testing import TOLERANCE, worst_error
from tests.passes.specs import generic_alibi as alibi

BF16 = ml_dtypes.bfloat16
NUMPY = {"f16": np.float16, "bf16": BF16, "f32": np.float32, "f64": np.float64}


def as_generic(spec: Spec) -> Spec:
    """``spec`` with its ``ac.f32`` arguments made ``ac.floating``: the same body, traced per float type."""
    fn = spec.fn
    copy = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy.__annotations__ = {
        name: TensorSpec(GENERIC, ann.dims) if isinstance(ann, TensorSpec) and ann.dtype == "f32" else ann
        for name, ann in inspect.get_annotations(fn, eval_str=True).items()
    }
    return ac.spec(copy)


def retyped(spec: Spec, dtype: str) -> Module:
    """``spec`` traced with its float32 arguments in ``dtype``."""
    return as_generic(spec).trace_as(dtype)


def rounded(arrays: list[np.ndarray], dtype: str) -> list[np.ndarray]:
    return [a.astype(NUMPY[dtype]) if a.dtype == np.float32 else a for a in arrays]


def as_list(result) -> list:
    return list(result) if isinstance(result, tuple | list) else [result]


def example_specs() -> list[tuple[str, str]]:
    found = []
    for name in example_names():
        module = load_example(name)
        if not hasattr(module, "make_inputs"):
            continue
        found += [(name, attr) for attr, value in vars(module).items() if isinstance(value, Spec)]
    return found


#: the examples also compiled for the cpu backend in 16-bit types (each is a compile)
ON_CPU = {("causal", "causal"), ("gqa", "grouped_query_attention"), ("alibi", "causal_alibi"), ("softcap", "softcap")}


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
@pytest.mark.parametrize(("example", "attr"), example_specs(), ids=lambda x: x if isinstance(x, str) else None)
def test_every_example_in_16_bits(example, attr, dtype):
    module = load_example(example)
    spec = getattr(module, attr)
    ir = retyped(spec, dtype)
    try:
        inputs = rounded(module.make_inputs(np.random.default_rng(3)), dtype)
        exact = ac.compile(ir, backend="interp").compilation.run(inputs, exact=True)
    except (TypeError, ac.ShapeError):
        pytest.skip("the example's inputs are for another of its specs")
    backends = ["interp"] + (["cpu"] if (example, attr) in ON_CPU and dtype == "bf16" else [])
    # results have the types the IR gives them: the call's (values a spec makes from positions and
    # Python numbers, such as rotary frequencies, are weak and take it)
    declared = [np.dtype(NUMPY[r.type.dtype]) for r in ir.main.results]
    for backend in backends:
        got = as_list(ac.compile(ir, backend=backend)(*inputs))
        assert [g.dtype for g in got] == declared
        assert worst_error(got, exact) < TOLERANCE[dtype], backend


def test_bf16_prints_parses_and_verifies():
    text = str(retyped(load_example("causal").causal, "bf16"))
    assert "tensor<B x H x T x D x bf16>" in text
    assert str(ac.parse_ir(text)) == text


def alibi_inputs(dtype: str, T: int = 20) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal((1, 2, T, 16)) for _ in range(3)] + [np.array([0.5, 0.25])]
    return [a.astype(NUMPY[dtype]) for a in arrays]


@pytest.fixture(scope="module")
def generic_cpu():
    return ac.compile(alibi, backend="cpu")


@pytest.fixture(scope="module")
def generic_interp():
    return ac.compile(alibi, backend="interp")


def exact_of(interp_fn, dtype: str, inputs: list[np.ndarray]) -> list[np.ndarray]:
    return interp_fn.for_dtype(dtype).compilation.run(inputs, exact=True)


@pytest.mark.parametrize("dtype", ["f16", "bf16", "f32", "f64"])
def test_a_generic_spec_follows_the_call(generic_cpu, generic_interp, dtype):
    inputs = alibi_inputs(dtype)
    out = generic_cpu(*inputs)
    assert out.dtype == NUMPY[dtype]
    assert worst_error([out], exact_of(generic_interp, dtype, inputs)) < TOLERANCE[dtype]
    assert f"tensor<B x H x T x D x {dtype}>" in generic_cpu.ir("input", dtype=dtype)
    assert dtype in generic_cpu.family.members  # compiled for it, once
    assert generic_cpu.for_dtype(dtype) is generic_cpu.for_dtype(dtype)


def test_mixed_float_types_name_the_argument(generic_interp):
    q, k, v, slopes = alibi_inputs("bf16")
    with pytest.raises(TypeError, match=r"^k: expected bf16 elements, the float type of this call \(that of q\)"):
        generic_interp(q, k.astype(np.float32), v, slopes)
    with pytest.raises(TypeError, match=r"^q: an ac.floating argument takes f16, bf16, f32 or f64 elements"):
        generic_interp(q.astype(np.int32), k, v, slopes)


@pytest.mark.parametrize(
    "logits,slope,T", [(1, 0.25, 20), (12, 0.25, 20), (1, -0.5, 40)], ids=["small", "large", "rising"]
)
def test_bf16_gradients_follow_the_float32_ones(generic_cpu, logits, slope, T):
    """Also with scores in the tens, where the log-sum-exp is: the backward rebuilds the softmax as
    ``exp(s - lse)``, so the LSE it saves is float32 (bf16 would be off by up to 0.25, the gradients
    by up to 28%).  A negative slope (scores rising with distance) weighs each row's
    ``delta = rowsum(d_out * out)`` by its distances in the slope's gradient: delta is summed in
    float32 (in bf16 the slope's gradient was off by 11% here)."""
    inputs = alibi_inputs("bf16", T)
    inputs[0] = (inputs[0].astype(np.float32) * logits).astype(BF16)
    inputs[3] = np.array([0.5, slope]).astype(BF16)
    out, pullback = generic_cpu.vjp(*inputs)
    cotangent = np.random.default_rng(1).standard_normal(out.shape).astype(BF16)
    grads = pullback(cotangent)
    assert all(g.dtype == BF16 for g in grads)
    widened = [x.astype(np.float32) for x in inputs]
    _, pullback32 = generic_cpu.vjp(*widened)
    want = pullback32(cotangent.astype(np.float32))
    assert worst_error(grads, want) < TOLERANCE["bf16"]


def test_a_bf16_decoder_holds_half_the_bytes(generic_cpu, generic_interp):
    inputs = alibi_inputs("bf16")
    steps = [(0, 12), (12, 13), (13, 20)]
    caches = {}
    for dtype in ("bf16", "f32"):
        dec = generic_cpu.decoder(32)  # takes the float type of its first call
        args = [x.astype(NUMPY[dtype]) for x in inputs]
        outs = [dec(*(x[:, :, a:b] for x in args[:3]), args[3]) for a, b in steps]
        caches[dtype] = sum(c.nbytes for c in dec.cache.values())
        if dtype == "bf16":  # the kernel streams the cache's bf16 bits, prefetching the next tile's
            assert "group_scores(qt, qt_bits, qt_is_bf16, ks_bits, sg, sg_spare, G, nq, nk, nk, 0)" in dec.fn.source
            values = "group_values(sg, vs_group, acc, active, row_ids, G, nq, nk_group, nk_group, 0, True)"
            assert values in dec.fn.source  # True: the output is bf16
            assert "'bf16')" in dec.fn.source
        got = np.concatenate(outs, axis=2)
        assert got.dtype == NUMPY[dtype]
        assert worst_error([got], exact_of(generic_interp, "bf16", inputs)) < TOLERANCE["bf16"]
    assert caches["bf16"] * 2 == caches["f32"]


def test_a_bf16_paged_pool(generic_cpu, generic_interp):
    inputs = alibi_inputs("bf16")
    server = generic_cpu.paged_decoder(page_size=8, num_pages=8, dtype="bf16")
    seq = server.new()
    outs = [server.step({seq: (*(x[:, :, a:b] for x in inputs[:3]), inputs[3])})[seq] for a, b in [(0, 9), (9, 20)]]
    assert all(array.dtype == BF16 for array in server.pool.arrays)
    got = np.concatenate(outs, axis=2)
    assert worst_error([got], exact_of(generic_interp, "bf16", inputs)) < TOLERANCE["bf16"]


def test_torch_bf16_tensors_passed_to_a_call(generic_cpu, generic_interp):
    """torch's CPU bf16 tensors (a strided one too) go to ``fn(...)`` and a decoder's steps as numpy's
    bf16 views of their memory, and the result is bf16; a tensor that requires grad is refused naming
    it (``fn.to_torch()`` computes gradients)."""
    torch = pytest.importorskip("torch")
    inputs = alibi_inputs("bf16")
    tensors = [torch.from_numpy(x.view(np.int16)).view(torch.bfloat16) for x in inputs]
    tensors[1] = tensors[1].transpose(2, 3).contiguous().transpose(2, 3)  # k strided
    for fn in (generic_cpu, generic_interp):
        got = fn(*tensors)
        assert got.dtype == BF16
        assert worst_error([got], exact_of(generic_interp, "bf16", inputs)) < TOLERANCE["bf16"]
    prefill = generic_cpu.decoder(32, dtype="bf16")(*tensors)  # a decoder's step takes them too
    assert prefill.dtype == BF16
    assert worst_error([prefill], exact_of(generic_interp, "bf16", inputs)) < TOLERANCE["bf16"]
    with pytest.raises(TypeError, match=r"^q: a tensor that requires grad.*q\.detach\(\)"):
        generic_cpu(tensors[0].clone().requires_grad_(), *tensors[1:])
    with pytest.raises(TypeError, match=r"^v: expected bf16"):  # the others' float type
        generic_cpu(*tensors[:2], tensors[2].float(), tensors[3])


def test_bf16_over_dask(generic_cpu, generic_interp):
    da = pytest.importorskip("dask.array")
    inputs = alibi_inputs("bf16", T=24)
    chunked = [da.from_array(x, chunks=(1, 2, 8, 16)) for x in inputs[:3]]
    got = generic_cpu(*chunked, inputs[3]).compute()
    assert got.dtype == BF16
    assert worst_error([got], exact_of(generic_interp, "bf16", inputs)) < TOLERANCE["bf16"]


def test_the_torch_op_of_a_generic_spec():
    torch = pytest.importorskip("torch")
    op = ac.compile(alibi, backend="cpu").to_torch()
    base = [torch.from_numpy(x) for x in alibi_inputs("f32")]
    want = op(*base)
    for dtype, bound in ((torch.bfloat16, TOLERANCE["bf16"]), (torch.float16, TOLERANCE["f16"])):
        args = [x.to(dtype).requires_grad_() for x in base]
        out = op(*args)
        assert out.dtype == dtype
        assert worst_error([out.float().detach().numpy()], [want.detach().numpy()]) < bound
        out.float().sum().backward()
        assert all(a.grad.dtype == dtype for a in args)
        torch.library.opcheck(op.op, tuple(a.detach() for a in args))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert op(*base).dtype == torch.bfloat16
