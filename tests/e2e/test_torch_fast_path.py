"""Eager calls of ``fn.to_torch()`` skip the dispatcher's round trip; they compute what the registered
custom op computes, gradients included, and a bad tensor after good calls gets the same error."""

import ml_dtypes
import numpy as np
import pytest

import attncomp as ac
from attncomp.compilation import Compilation
from attncomp.errors import ShapeError
from tests.passes import specs

torch = pytest.importorskip("torch", reason="the torch extra is not installed: pip install 'attncomp[torch]'")

from attncomp.torch.eager import eager_dtypes  # noqa: E402


@pytest.fixture(scope="module")
def op():
    return ac.compile(specs.causal_alibi, backend="cpu").to_torch()


def tensors(T=6, requires_grad=False, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    qkv = [torch.randn((1, 2, T, 8), generator=g, dtype=dtype) for _ in range(3)]
    slopes = torch.tensor([0.5, 0.25], dtype=dtype)
    return [t.requires_grad_(requires_grad) for t in (*qkv, slopes)]


def test_eager_calls_take_the_short_path_and_agree_with_the_op(op):
    args = tensors()
    assert eager_dtypes(torch, args, "cpu") == tuple(t.dtype for t in args)
    assert eager_dtypes(torch, [t.to("meta") for t in args], "cpu") is None  # fake functions: the op
    assert eager_dtypes(torch, args, "cuda") is None  # another device: the op, whose checks name it
    parameters = [torch.nn.Parameter(t) for t in args]  # a module's weights: plain tensors for the op
    assert eager_dtypes(torch, parameters, "cpu") == tuple(t.dtype for t in args)
    np.testing.assert_array_equal(op(*args).numpy(), op.op(*args)[0].numpy())


def test_eager_gradients_equal_the_registered_autograd(op):
    cotangent = torch.randn((1, 2, 6, 8), generator=torch.Generator().manual_seed(3))
    eager, dispatched = tensors(requires_grad=True), tensors(requires_grad=True)
    op(*eager).backward(cotangent)
    op.op(*dispatched)[0].backward(cotangent)
    for a, b in zip(eager, dispatched):
        np.testing.assert_allclose(a.grad.numpy(), b.grad.numpy(), rtol=1e-6, atol=1e-7)
    for call in (op, lambda *args: op.op(*args)[0]):
        # no second derivative, on either path (one autograd): an error where one is taken, even when
        # the cotangent (of out.sum()) needs no gradient, never a gradient penalty silently dropped
        args = tensors(requires_grad=True)
        out = call(*args)
        (grad,) = torch.autograd.grad(out.sum(), args[0], create_graph=True)
        with pytest.raises(RuntimeError, match="no second derivative"):
            (out.sum() + grad.pow(2).sum()).backward()


def test_a_backward_under_a_dispatch_mode_runs_the_registered_backward_op(op):
    """The backward takes the call's rule: under a mode that watches ops it goes through the registered
    backward op (which the mode sees), with the gradients of the eager backward."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Recording(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    cotangent = torch.randn((1, 2, 6, 8), generator=torch.Generator().manual_seed(4))
    eager, watched = tensors(requires_grad=True), tensors(requires_grad=True)
    op(*eager).backward(cotangent)
    out = op(*watched)  # the eager forward
    with Recording() as mode:
        out.backward(cotangent)
    assert any(name.startswith(f"attncomp.{op.name}_backward") for name in mode.seen), mode.seen
    for a, b in zip(eager, watched):
        np.testing.assert_allclose(a.grad.numpy(), b.grad.numpy(), rtol=1e-6, atol=1e-7)


def test_repeated_gradient_calls_reuse_their_sizes_and_keep_the_inplace_check(op):
    """Later calls of a key run on the sizes the first bound (and the backward on the forward's
    views); a new size binds again; a saved input edited in place is torch's error, as ever."""
    for T in (6, 6, 6, 5, 6):
        cotangent = torch.randn((1, 2, T, 8), generator=torch.Generator().manual_seed(T))
        eager, dispatched = tensors(T=T, requires_grad=True, seed=T), tensors(T=T, requires_grad=True, seed=T)
        op(*eager).backward(cotangent)
        op.op(*dispatched)[0].backward(cotangent)
        for a, b in zip(eager, dispatched):
            np.testing.assert_allclose(a.grad.numpy(), b.grad.numpy(), rtol=1e-6, atol=1e-7)
    args = tensors(requires_grad=True)
    out = op(*args)
    with torch.no_grad():
        args[1].mul_(2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


@ac.spec
def bias_in_f32(q: ac.floating["T", "D"], k: ac.floating["S", "D"], v: ac.floating["S", "D"], bias: ac.f32["T", "S"]):
    return ac.softmax(q @ k.mT + bias) @ v


@ac.spec
def key_in_f32(q: ac.floating["T", "D"], k: ac.f32["S", "D"], v: ac.floating["S", "D"]):
    return ac.softmax(q @ k.mT) @ v


def test_an_f32_bias_in_a_bf16_call_fuses_with_gradients():
    """bf16 q, k, v with an f32 bias: the fused op computes its scores in float32 reading the bias as
    it is, returns bf16, and one op serves both float types, with gradients in each argument's type."""
    fn = ac.compile(bias_in_f32, backend="cpu")
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn((n, 8), generator=g).bfloat16() for n in (5, 6, 6))
    bias = torch.randn((5, 6), generator=g)
    op = fn.to_torch()
    want = op(*(t.float() for t in (q, k, v)), bias)
    args = [t.clone().requires_grad_() for t in (q, k, v, bias)]
    got = op(*args)
    assert got.dtype == torch.bfloat16
    np.testing.assert_allclose(got.float().detach().numpy(), want.numpy(), rtol=1e-2, atol=1e-2)
    got.float().sum().backward()
    assert [a.grad.dtype for a in args] == [torch.bfloat16] * 3 + [torch.float32]
    wide = [t.float().requires_grad_() for t in (q, k, v, bias)]
    op(*wide).sum().backward()
    for a, w in zip(args, wide):
        np.testing.assert_allclose(a.grad.float().numpy(), w.grad.numpy(), rtol=3e-2, atol=3e-2)


def test_a_bf16_value_with_an_f32_key_on_cpu():
    """Values widened from bf16 while keys are read as float32: the kernel stages the values alone."""
    fn = ac.compile(key_in_f32, backend="cpu")
    rng = np.random.default_rng(12)
    q, k, v = (rng.standard_normal((n, 8)).astype(np.float32) for n in (70, 140, 140))
    q16, v16 = (x.astype(ml_dtypes.bfloat16) for x in (q, v))
    want = ac.compile(key_in_f32, backend="interp")(q16, k, v16).astype(np.float64)  # float64 inside
    np.testing.assert_allclose(fn(q16, k, v16).astype(np.float64), want, rtol=1e-2, atol=1e-2)


def test_expanded_inputs_are_saved_as_views():
    """GQA written with ``k.expand(...)``: the backward keeps the views, not full-size copies."""
    op = ac.compile(specs.causal, backend="cpu").to_torch()
    g = torch.Generator().manual_seed(13)
    q = torch.randn((2, 4, 16, 8), generator=g, requires_grad=True)
    k, v = (torch.randn((1, 1, 16, 8), generator=g, requires_grad=True) for _ in range(2))
    held = []

    def pack(t):
        held.append(t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = op(q, k.expand(2, 4, 16, 8), v.expand(2, 4, 16, 8))
    assert sorted(held)[:2] == [k.untyped_storage().nbytes()] * 2, held
    out.sum().backward()
    plain = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    op.op(plain[0], plain[1].expand(2, 4, 16, 8), plain[2].expand(2, 4, 16, 8))[0].sum().backward()
    for a, b in zip((q, k, v), plain):
        np.testing.assert_allclose(a.grad.numpy(), b.grad.numpy(), rtol=1e-5, atol=1e-6)


def test_bad_tensors_after_good_calls_get_the_same_errors(op):
    for _ in range(3):
        op(*tensors())
    q, k, v, slopes = tensors()
    with pytest.raises(TypeError, match="q: expected f32"):
        op(q.double(), k, v, slopes)
    with pytest.raises(ShapeError, match="k"):
        op(q, k[:, :1], v, slopes)
    with pytest.raises(ValueError, match="q: a meta tensor"):
        op.forward_impl(q.to("meta"), k, v, slopes)
    np.testing.assert_allclose(op(*tensors(T=9)).shape, (1, 2, 9, 8))  # a new shape after the errors


def test_eager_gradients_of_strided_inputs_and_a_broadcast_cotangent(op, monkeypatch):
    """A strided view is copied once (the backward reads the copy); ``.sum().backward()`` gives a
    zero-stride cotangent."""
    base = tensors(requires_grad=True)
    x = torch.randn((1, 6, 2, 8), generator=torch.Generator().manual_seed(5), requires_grad=True)
    strided = [x.transpose(1, 2), *base[1:]]  # q as a transposed view
    runs = []
    run = Compilation.run_contiguous  # every run of the op's numpy views on the cpu

    def recording_run(self, args):
        runs.append((self.name, list(args)))
        return run(self, args)

    monkeypatch.setattr(Compilation, "run_contiguous", recording_run)
    op(*strided).sum().backward()
    monkeypatch.undo()
    (name, forward_args), (backward_name, backward_args) = runs
    assert not name.endswith("_backward") and backward_name.endswith("_backward")
    assert forward_args[0].flags.c_contiguous and not np.shares_memory(forward_args[0], x.detach().numpy())
    assert np.shares_memory(backward_args[0], forward_args[0]), (
        "the backward reads the forward's copy of q, not a second one"
    )
    plain = [x.detach().transpose(1, 2).contiguous().requires_grad_(), *tensors(requires_grad=True)[1:]]
    op.op(*plain)[0].sum().backward()
    np.testing.assert_allclose(x.grad.transpose(1, 2).numpy(), plain[0].grad.numpy(), rtol=1e-6, atol=1e-7)
    for a, b in zip(base[1:], plain[1:]):
        np.testing.assert_allclose(a.grad.numpy(), b.grad.numpy(), rtol=1e-6, atol=1e-7)


@ac.spec
def out_twice(q: ac.f32["B", "H", "T", "D"], k: ac.f32["B", "H", "S", "D"], v: ac.f32["B", "H", "S", "D"]):
    s = (q @ k.mT) * q.shape[-1] ** -0.5
    o = ac.softmax(s, axis=-1) @ v
    return o, o


def test_a_result_returned_twice_takes_both_cotangents_once_each():
    fn = ac.compile(out_twice, backend="cpu")
    twice = fn.to_torch()
    g = torch.Generator().manual_seed(7)
    weights = [torch.randn((1, 2, 5, 8), generator=g) for _ in range(2)]
    for eager in (True, False):  # the short path, and the registered op (its outputs: distinct values)
        args = [t.requires_grad_() for t in tensors(T=5)[:3]]
        if eager:
            a, b = twice(*args)
        else:
            outputs = twice.op(*args)
            a, b = (outputs[slot] for slot in twice.slots.result_slots)
        assert a.data_ptr() == b.data_ptr()  # one value, one tensor
        ((a * weights[0]).sum() + (b * weights[1]).sum()).backward()
        _, pullback = fn.vjp(*(t.detach().numpy() for t in args))
        for t, want in zip(args, pullback(weights[0].numpy(), weights[1].numpy())):
            np.testing.assert_allclose(t.grad.numpy(), want, rtol=1e-5, atol=1e-6)
