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


def test_max_scores_match_pytorchs_flex_attention():
    """``return_aux=AuxRequest(lse=True, max_scores=True)`` in bf16 on the tensor cores (whole chunks in
    the main loop; a row that sees no key: ``-inf``) against PyTorch's FlexAttention on the GPU."""
    g = torch.Generator(device="cuda").manual_seed(1)
    length = 512
    q = torch.randn(1, 8, length, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(1, 8, length, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))

    def causal_but_row_7(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx != 7)

    request = flex.AuxRequest(lse=True, max_scores=True)
    mask = acf.create_block_mask(causal_but_row_7, None, None, length, length)
    out, aux = acf.flex_attention(q, k, v, block_mask=mask, return_aux=request)
    theirs = flex.create_block_mask(causal_but_row_7, None, None, length, length, device="cuda")
    want_out, want = torch.compile(flex.flex_attention)(q, k, v, block_mask=theirs, return_aux=request)
    torch.testing.assert_close(out, want_out, **TOLERANCE[torch.bfloat16])
    assert torch.isneginf(aux.max_scores[:, :, 7]).all()
    shown = ~torch.isneginf(want.max_scores)
    torch.testing.assert_close(aux.max_scores[shown], want.max_scores[shown], rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(aux.lse[shown], want.lse[shown], rtol=1e-2, atol=1e-2)
