"""``attncomp.flex.flex_attention`` on CUDA tensors against PyTorch's FlexAttention on the GPU: a
document mask with an ALiBi score_mod (slopes captured), GQA, bf16 and float32, forward and gradients."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the torch extra is not installed")
if not torch.cuda.is_available():
    pytest.skip("PyTorch sees no CUDA GPU", allow_module_level=True)

flex = pytest.importorskip("torch.nn.attention.flex_attention")

import attncomp.flex as acf  # noqa: E402

TOLERANCE = {torch.bfloat16: dict(rtol=3e-2, atol=3e-2), torch.float32: dict(rtol=2e-3, atol=2e-3)}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_document_mask_and_alibi_match_pytorchs_flex_attention(dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    length = 300
    q = torch.randn(2, 8, length, 64, device="cuda", dtype=dtype, generator=g).requires_grad_()
    k, v = (torch.randn(2, 2, length, 64, device="cuda", dtype=dtype, generator=g).requires_grad_() for _ in range(2))
    doc = (torch.arange(length, device="cuda") // 70).to(torch.int32)
    slopes = torch.linspace(0.5, 0.05, 8, device="cuda")

    def documents(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    out = acf.flex_attention(
        q, k, v, alibi, acf.create_block_mask(documents, None, None, length, length), enable_gqa=True
    )
    assert out.is_cuda and out.dtype == dtype
    d_out = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), d_out)
    mask = flex.create_block_mask(documents, None, None, length, length, device="cuda")
    want_out = torch.compile(flex.flex_attention)(q, k, v, alibi, mask, enable_gqa=True)
    want = torch.autograd.grad(want_out, (q, k, v), d_out)
    torch.testing.assert_close(out, want_out, **TOLERANCE[dtype])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **TOLERANCE[dtype])
