"""bf16 training through ``fn.to_torch()`` on the GPU: the tensor-core forward and backward against
SDPA in bf16 and against float32 arithmetic, under ``torch.autocast``, and a bf16 model whose loss
curve follows the same model with SDPA.
"""

# Dimension names in annotations (ac.floating["T", "D"]) are not forward references.
# ruff: noqa: F821, UP037

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the torch extra is not installed")
if not torch.cuda.is_available():
    pytest.skip("PyTorch sees no CUDA GPU", allow_module_level=True)

import attncomp as ac  # noqa: E402
from tests.conftest import load_example  # noqa: E402


@ac.spec
def causal(q: ac.floating["B", "H", "T", "D"], k: ac.floating["B", "H", "S", "D"], v: ac.floating["B", "H", "S", "E"]):
    s = (q @ k.mT) * q.shape[-1] ** -0.5
    b, h, i, j = ac.index(s)
    return ac.softmax(ac.where(j <= i, s, -ac.inf), axis=-1) @ v


def _sdpa(q, k, v):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def _step(attention, q, k, v, d_out):
    """The output and the three gradients of one step."""
    inputs = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out = attention(*inputs)
    out.backward(d_out)
    return [out.detach(), *(x.grad for x in inputs)]


def _relative(got, want) -> float:
    got, want = got.double(), want.double()
    return float((got - want).abs().max() / want.abs().max())


@pytest.mark.parametrize("head_dim", [64, 128])
def test_bf16_gradients_against_float32_and_sdpa(head_dim):
    """bf16 output and gradients (products on mma.sync, forward and backward) within bf16 rounding of
    the float32 ones from the same rounded inputs, and as close to them as SDPA's bf16 ones."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    shape = (2, 4, 333, head_dim)
    q, k, v, d_out = (torch.randn(shape, device="cuda", generator=generator).bfloat16() for _ in range(4))
    attn = ac.compile(causal, backend="cuda").to_torch()
    ours = _step(attn, q, k, v, d_out)
    theirs = _step(_sdpa, q, k, v, d_out)
    exact = _step(_sdpa, q.float(), k.float(), v.float(), d_out.float())
    assert all(x.dtype == torch.bfloat16 for x in ours)
    for name, got, peer, want in zip(("out", "dq", "dk", "dv"), ours, theirs, exact):
        error, peer_error = _relative(got, want), _relative(peer, want)
        assert error < 2e-2, f"{name}: {error:.2e}"
        assert error < 4 * peer_error + 4e-3, f"{name}: {error:.2e} against SDPA's {peer_error:.2e}"


def test_autocast_runs_the_op_in_bf16():
    """Under torch.autocast("cuda", bfloat16) float32 inputs run the generic spec in bf16, and the
    gradients reach the float32 leaves in float32."""
    generator = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn((1, 4, 200, 64), device="cuda", generator=generator).requires_grad_() for _ in range(3))
    attn = ac.compile(causal, backend="cuda").to_torch()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = attn(q, k, v)
        want = _sdpa(q, k, v)
    assert out.dtype == want.dtype == torch.bfloat16
    assert _relative(out.detach(), want.detach()) < 2e-2
    out.float().square().mean().backward()
    assert all(x.grad is not None and x.grad.dtype == torch.float32 for x in (q, k, v))


def test_tiny_lm_in_bf16_follows_sdpa():
    """examples/train_tiny_lm.py --device cuda --dtype bf16 --attention causal: twenty Adam steps of
    the same bf16 model with attncomp's attention and with SDPA's give the same losses, and lower."""
    example = load_example("train_tiny_lm")
    options = {"device": "cuda", "dtype": "bf16", "attention": "causal", "half": 64, "width": 64, "heads": 4}
    ours, _ = example.train("attncomp", 20, **options)
    theirs, _ = example.train("torch", 20, **options)
    assert ours[-1] < ours[0]
    for step, (a, b) in enumerate(zip(ours, theirs)):
        assert abs(a - b) <= 3e-2 * abs(b), f"step {step + 1}: {a} against {b}"
