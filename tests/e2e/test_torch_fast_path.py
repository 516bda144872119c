"""Eager calls of ``fn.to_torch()`` skip the dispatcher's round trip; they compute what the registered
custom op computes, gradients included, and a bad tensor after good calls gets the same error."""

import numpy as np
import pytest

import attncomp as ac
from attncomp.errors import ShapeError
from tests.passes import specs

torch = pytest.importorskip("torch", reason="the torch extra is not installed: pip install 'attncomp[torch]'")

from attncomp import torch_op  # noqa: E402


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
    assert torch_op.eager_dtypes(torch, args, "cpu") == tuple(t.dtype for t in args)
    assert torch_op.eager_dtypes(torch, [t.to("meta") for t in args], "cpu") is None  # fake functions: the op
    assert torch_op.eager_dtypes(torch, args, "cuda") is None  # another device: the op, whose checks name it
    parameters = [torch.nn.Parameter(t) for t in args]  # a module's weights: plain tensors for the op
    assert torch_op.eager_dtypes(torch, parameters, "cpu") == tuple(t.dtype for t in args)
    np.testing.assert_array_equal(op(*args).numpy(), op.op(*args)[0].numpy())


def test_eager_gradients_equal_the_registered_autograd(op):
    cotangent = torch.randn((1, 2, 6, 8), generator=torch.Generator().manual_seed(3))
    eager, dispatched = tensors(requires_grad=True), tensors(requires_grad=True)
    op(*eager).backward(cotangent)
    op.op(*dispatched)[0].backward(cotangent)
    for a, b in zip(eager, dispatched):
        np.testing.assert_allclose(a.grad.numpy(), b.grad.numpy(), rtol=1e-6, atol=1e-7)
    for call in (op, lambda *args: op.op(*args)[0]):  # no second derivative, on either path
        args = tensors(requires_grad=True)
        with pytest.raises(RuntimeError):
            (grad,) = torch.autograd.grad(call(*args).sum(), args[0], create_graph=True)
            grad.sum().backward()


def test_bad_tensors_after_good_calls_get_the_same_errors(op):
    for _ in range(3):
        op(*tensors())
    q, k, v, slopes = tensors()
    with pytest.raises(TypeError, match="q: expected f32"):
        op(q.double(), k, v, slopes)
    with pytest.raises(ShapeError, match="k"):
        op(q, k[:, :1], v, slopes)
    with pytest.raises(ValueError, match="q: a meta tensor"):
        op._run(op.fn.compilation, [q.to("meta"), k, v, slopes])
    np.testing.assert_allclose(op(*tensors(T=9)).shape, (1, 2, 9, 8))  # a new shape after the errors
