"""``attncomp.flash_attn`` on CUDA tensors against PyTorch's SDPA on the GPU (FlashAttention's layout,
``[B, T, H, D]``, transposed for SDPA): a causal sliding window with GQA in bf16 and float32, forward
and gradients; packed sequences against each sequence alone; a decoding step appending to a paged cache;
packed queries against a paged cache."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the torch extra is not installed")
if not torch.cuda.is_available():
    pytest.skip("PyTorch sees no CUDA GPU", allow_module_level=True)

import torch.nn.functional as F  # noqa: E402

import attncomp.flash_attn as fa  # noqa: E402

TOLERANCE = {torch.bfloat16: dict(rtol=3e-2, atol=3e-2), torch.float32: dict(rtol=2e-3, atol=2e-3)}


def sdpa(q, k, v, mask):
    heads = q.shape[2] // k.shape[2]
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    k, v = (x.repeat_interleave(heads, 1) for x in (k, v))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)


def window_mask(t, s, left, device):
    d = torch.arange(t, device=device)[:, None] + (s - t) - torch.arange(s, device=device)[None]
    return (d >= 0) & (d <= left)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_a_causal_window_matches_sdpa_forward_and_gradients(dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 300, 8, 64, device="cuda", dtype=dtype, generator=g).requires_grad_()
    k, v = (torch.randn(2, 340, 2, 64, device="cuda", dtype=dtype, generator=g).requires_grad_() for _ in range(2))
    out = fa.flash_attn_func(q, k, v, causal=True, window_size=(96, 0))
    assert out.is_cuda and out.dtype == dtype and out.shape == q.shape
    want = sdpa(q, k, v, window_mask(300, 340, 96, "cuda"))
    torch.testing.assert_close(out, want, **TOLERANCE[dtype])
    d_out = torch.randn_like(out)
    for got, expected in zip(torch.autograd.grad(out, (q, k, v), d_out), torch.autograd.grad(want, (q, k, v), d_out)):
        torch.testing.assert_close(got, expected, **TOLERANCE[dtype])


def test_packed_sequences_match_each_sequence_alone():
    lengths = [70, 200, 31]
    cu = torch.tensor([0, 70, 270, 301], dtype=torch.int32, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(301, 4, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    out = fa.flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths), causal=True)
    for b in range(3):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        n = lengths[b]
        want = sdpa(q[None, rows], k[None, rows], v[None, rows], window_mask(n, n, n, "cuda"))[0]
        torch.testing.assert_close(out[rows], want, **TOLERANCE[torch.bfloat16])


def test_a_decoding_step_on_a_paged_cache():
    """A new token appended through the table, then the pages read in place (``ac.page_view``)."""
    g = torch.Generator(device="cuda").manual_seed(2)
    pages = [torch.randn(16, 64, 2, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2)]
    table = torch.tensor([[3, 7, 1], [5, 2, 9]], dtype=torch.int32, device="cuda")
    lengths = torch.tensor([100, 150], dtype=torch.int32, device="cuda")
    q = torch.randn(2, 1, 8, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(2, 1, 2, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    out = fa.flash_attn_with_kvcache(q, *pages, k, v, cache_seqlens=lengths, block_table=table, causal=True)
    for b in range(2):
        n = int(lengths[b]) + 1
        keys, values = (p[table[b].long()].flatten(0, 1)[None, :n] for p in pages)
        torch.testing.assert_close(keys[0, n - 1], k[b, 0])
        want = sdpa(q[b : b + 1], keys, values, None)
        torch.testing.assert_close(out[b : b + 1], want, **TOLERANCE[torch.bfloat16])


def test_packed_queries_against_a_paged_cache():
    """``flash_attn_varlen_func`` with ``block_table``: two prefill chunks of 40 and 7 queries against
    130 and 47 keys in pages of 64, read in place (the tensor cores' asynchronous copies)."""
    g = torch.Generator(device="cuda").manual_seed(3)
    pages = [torch.randn(12, 64, 2, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2)]
    table = torch.tensor([[4, 0, 11], [8, 6, 0]], dtype=torch.int32, device="cuda")
    cu_q = torch.tensor([0, 40, 47], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 130, 177], dtype=torch.int32, device="cuda")
    q = torch.randn(47, 8, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    out = fa.flash_attn_varlen_func(q, *pages, cu_q, cu_k, 40, 130, causal=True, block_table=table)
    for b, (t, s) in enumerate([(40, 130), (7, 47)]):
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        keys, values = (p[table[b].long()].flatten(0, 1)[None, :s] for p in pages)
        want = sdpa(q[None, rows], keys, values, window_mask(t, s, s, "cuda"))[0]
        torch.testing.assert_close(out[rows], want, **TOLERANCE[torch.bfloat16])
