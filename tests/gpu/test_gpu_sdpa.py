"""``attncomp.sdpa.scaled_dot_product_attention`` on CUDA tensors against PyTorch's SDPA on the GPU:
causal GQA and a key-padding mask, forward and gradients, in bf16 and float32; dropout's seed a CPU
scalar passed to the kernels by value."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the torch extra is not installed")
if not torch.cuda.is_available():
    pytest.skip("PyTorch sees no CUDA GPU", allow_module_level=True)

from attncomp.sdpa import scaled_dot_product_attention as sdpa  # noqa: E402

F = torch.nn.functional.scaled_dot_product_attention
TOLERANCE = {torch.bfloat16: dict(rtol=3e-2, atol=3e-2), torch.float32: dict(rtol=2e-3, atol=2e-3)}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("masked", [False, True], ids=["causal", "key padding"])
def test_forward_and_gradients_match_pytorchs_on_the_gpu(dtype, masked):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 8, 200, 64, device="cuda", dtype=dtype, generator=g).requires_grad_()
    k, v = (torch.randn(2, 2, 200, 64, device="cuda", dtype=dtype, generator=g).requires_grad_() for _ in range(2))
    options: dict = {"is_causal": True}
    if masked:
        mask = torch.ones(2, 1, 1, 200, dtype=torch.bool, device="cuda")
        mask[1, ..., 150:] = False
        options = {"attn_mask": mask}
    out = sdpa(q, k, v, enable_gqa=True, **options)
    assert out.is_cuda and out.dtype == dtype
    d_out = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), d_out)
    want_out = F(q, k, v, enable_gqa=True, **options)
    want = torch.autograd.grad(want_out, (q, k, v), d_out)
    torch.testing.assert_close(out, want_out, **TOLERANCE[dtype])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **TOLERANCE[dtype])


def test_dropout_with_a_cpu_seed_on_the_gpu():
    q, k, v = (torch.randn(1, 4, 128, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    torch.manual_seed(3)
    first = sdpa(q, k, v, is_causal=True, dropout_p=0.2)
    torch.manual_seed(3)
    again = sdpa(q, k, v, is_causal=True, dropout_p=0.2)
    assert torch.equal(first, again)  # the same seed, the same mask
    assert (first.float() - sdpa(q, k, v, is_causal=True).float()).abs().max() > 0.05
