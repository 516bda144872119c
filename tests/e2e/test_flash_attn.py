"""``attncomp.flash_attn``: FlashAttention's functions against the attention FlashAttention documents,
written densely in float64 torch (FlashAttention itself runs on no CPU): whole sequences with causal
masks, windows, soft-caps, ALiBi and grouped heads, queries fewer or more than keys; packed sequences;
a decoding step appending to a contiguous or paged cache with rotary tables; gradients; the
log-sum-exp; dropout; ``torch.compile``; refusals by name.  Most cases run on the ``interp``
backend (the specs' arithmetic in float64), the rest on ``cpu`` as a user calls them."""

from __future__ import annotations

import math

import pytest

from tests.conftest import TORCH_COMPILE

torch = pytest.importorskip("torch")

import attncomp.flash_attn as fa  # noqa: E402
from attncomp.flash_attn import calls  # noqa: E402

B, H, KV, D = 2, 4, 2, 16


def reference(q, k, v, causal=False, window=(-1, -1), softcap=0.0, slopes=None, scale=None, shown=None):
    """FlashAttention's definition for ``[B, T, H, D]`` tensors, in float64: ``d = i + S - T - j``;
    ``shown[b, j]`` hides keys where False.  Gives the output and the log-sum-exp ``[B, H, T]``."""
    t, s_len, heads = q.shape[1], k.shape[1], q.shape[2]
    qh, kh, vh = (x.double().transpose(1, 2) for x in (q, k, v))
    kh, vh = (x.repeat_interleave(heads // x.shape[1], 1) for x in (kh, vh))
    s = qh @ kh.mT * (q.shape[-1] ** -0.5 if scale is None else scale)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    d = torch.arange(t)[:, None] + (s_len - t) - torch.arange(s_len)[None]
    if slopes is not None:
        rows = slopes.double() if slopes.dim() == 2 else slopes.double()[None]
        s = s - rows[:, :, None, None] * d.abs()
    visible = torch.ones(s.shape, dtype=torch.bool)
    if causal:
        visible &= d >= 0
    if window[0] >= 0:
        visible &= d <= window[0]
    if window[1] >= 0 and not causal:
        visible &= d >= -window[1]
    if shown is not None:
        visible &= shown[:, None, None, :]
    s = s.masked_fill(~visible, -math.inf)
    return (torch.softmax(s, -1).nan_to_num(0.0) @ vh).transpose(1, 2), torch.logsumexp(s, -1)


def tensors(t=21, s=29, seed=0, dtype=torch.float32, heads=H, kv_heads=KV):
    g = torch.Generator().manual_seed(seed)
    shapes = ((B, t, heads, D), (B, s, kv_heads, D), (B, s, kv_heads, D))
    return [torch.randn(*shape, generator=g, dtype=dtype) for shape in shapes]


SLOPES = torch.tensor([0.5, 0.25, 0.125, 0.0625])
CASES = {
    "full": dict(),
    "causal": dict(causal=True),
    "causal-window": dict(causal=True, window=(6, 0)),
    "two-sided-window": dict(window=(5, 3)),
    "softcap": dict(softcap=2.0, scale=0.4),
    "alibi-causal": dict(slopes=SLOPES, causal=True),
    "alibi-per-row": dict(slopes=torch.stack([SLOPES, SLOPES.flip(0)]), window=(-1, 4)),
}


def call(q, k, v, backend="interp", causal=False, window=(-1, -1), softcap=0.0, slopes=None, scale=None, **kw):
    return fa.flash_attn_func(
        q, k, v, softmax_scale=scale, causal=causal, window_size=window, softcap=softcap, alibi_slopes=slopes,
        backend=backend, **kw,
    )  # fmt: skip


@pytest.mark.parametrize("lengths", [(21, 29), (29, 21)], ids=["fewer-queries", "more-queries"])
@pytest.mark.parametrize("case", list(CASES))
def test_whole_sequences_match_flash_attentions_definition(case, lengths):
    """Queries aligned to the last key (with more queries than keys the first see none: zeros, and a
    log-sum-exp of -inf); MQA/GQA heads; the log-sum-exp with ``return_attn_probs``."""
    q, k, v = tensors(*lengths)
    out, lse, empty = call(q, k, v, return_attn_probs=True, **CASES[case])
    want, want_lse = reference(q, k, v, **CASES[case])
    assert out.shape == (B, lengths[0], H, D) and lse.shape == (B, H, lengths[0]) and empty.numel() == 0
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse.double(), want_lse.float().double(), rtol=1e-5, atol=1e-5)


def test_on_the_cpu_backend_forward_and_gradients_match():
    """Every mask at once on the compiled CPU kernels: the output, and the gradients of q, k and v
    against the float64 reference's."""
    q, k, v = (x.double().requires_grad_() for x in tensors(seed=1))
    options = dict(causal=True, window=(9, 0), softcap=3.0, slopes=SLOPES)
    out = call(*(x.float() for x in (q, k, v)), backend="cpu", **options)
    want = reference(q, k, v, **options)[0]
    torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=1e-5)
    cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    got = torch.autograd.grad((out * cotangent).sum(), (q, k, v))
    expected = torch.autograd.grad((want * cotangent).sum(), (q, k, v))
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_bfloat16_and_the_packed_forms():
    q, k, v = (x.to(torch.bfloat16) for x in tensors(seed=3))
    out = call(q, k, v, backend="cpu", causal=True)
    assert out.dtype == torch.bfloat16
    want = reference(q, k, v, causal=True)[0]
    assert (out.double() - want).abs().max() < 2e-2
    same = fa.flash_attn_kvpacked_func(q, torch.stack((k, v), 2), causal=True, backend="cpu")
    assert torch.equal(same, out)
    q, k, v = tensors(t=29, seed=4, kv_heads=H)
    packed = fa.flash_attn_qkvpacked_func(torch.stack((q, k, v), 2), causal=True, backend="interp")
    torch.testing.assert_close(packed, call(q, k, v, causal=True))


LQ, LK = [5, 0, 17, 9], [8, 3, 17, 12]  # an empty sequence; keys more than queries


def packed(seed=5):
    g = torch.Generator().manual_seed(seed)
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32) for n in (LQ, LK))
    q = torch.randn(sum(LQ) + 2, H, D, generator=g)  # two positions past the last sequence
    k, v = (torch.randn(sum(LK) + 3, KV, D, generator=g) for _ in range(2))
    return q, k, v, cu_q, cu_k


@pytest.mark.parametrize(
    "options",
    [dict(causal=True), dict(window=(3, 2)), dict(causal=True, slopes=torch.rand(4, H), softcap=3.0)],
    ids=["causal", "window", "alibi-softcap"],
)
def test_packed_sequences_attend_within_their_own(options):
    """Each sequence as if called alone (ALiBi slopes per sequence); positions past the last offset
    take part in nothing (their output zeros, the extra keys seen by no query)."""
    q, k, v, cu_q, cu_k = packed()
    out, lse, _ = fa.flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, max(LQ), max(LK), softcap=options.get("softcap", 0.0), causal=options.get("causal", False),
        window_size=options.get("window", (-1, -1)), alibi_slopes=options.get("slopes"), return_attn_probs=True,
        backend="interp",
    )  # fmt: skip
    assert out.shape == q.shape and lse.shape == (H, q.shape[0])
    for b in range(len(LQ)):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        alone = dict(options)
        if "slopes" in alone:
            alone["slopes"] = alone["slopes"][b]
        want, want_lse = reference(q[rows][None], k[keys][None], v[keys][None], **alone)
        torch.testing.assert_close(out[rows].double(), want[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(lse[:, rows].double(), want_lse[0].float().double(), rtol=1e-5, atol=1e-5)
    assert out[-2:].abs().max() == 0


def test_packed_sequences_on_the_cpu_backend_with_gradients():
    q, k, v, cu_q, cu_k = packed(seed=6)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out = fa.flash_attn_varlen_kvpacked_func(q, torch.stack((k, v), 1), cu_q, cu_k, 17, 17, causal=True)
    got = torch.autograd.grad(out.square().sum(), (q, k, v))
    parts = []
    for b in range(len(LQ)):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        parts.append(reference(q[rows][None], k[keys][None], v[keys][None], causal=True)[0][0])
    want = torch.cat(parts)
    torch.testing.assert_close(out[: want.shape[0]].double(), want, rtol=1e-4, atol=1e-5)
    expected = torch.autograd.grad(want.square().sum(), (q, k, v))
    for a, b in zip(got, expected):
        torch.testing.assert_close(a.double(), b.double(), rtol=1e-4, atol=1e-5)
    qkv = torch.stack((q, q, q), 1).detach()  # one cu_seqlens for queries and keys
    self_attention = fa.flash_attn_varlen_qkvpacked_func(qkv, cu_q, 17, causal=True)
    alone = reference(q[None, 5:22], q[None, 5:22], q[None, 5:22], causal=True)[0][0]
    torch.testing.assert_close(self_attention[5:22].double(), alone, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", ["interp", "cpu"])
@pytest.mark.parametrize("grad", [True, False], ids=["gradients", "in-place"])
def test_packed_queries_against_a_paged_cache(backend, grad, monkeypatch):
    """``flash_attn_varlen_func`` with ``block_table``: packed prefill chunks, each sequence's keys the
    first of its pages (in the table's order, scattered over the pool; entries past its keys unused,
    out of the pool's range), its queries aligned to its last key, as if called alone; gradients of
    the queries and of the pages read; without gradients, the pages read in place (never gathered)."""
    if not grad:
        monkeypatch.setattr(calls, "table_rows", None)  # a call that gathered the pages would fail
    page, pages_a_row = 4, 5
    q, k, v, cu_q, cu_k = packed(seed=9)
    g = torch.Generator().manual_seed(10)
    k_pages, v_pages = (torch.randn(24, page, KV, D, generator=g) for _ in range(2))
    table = torch.randperm(24, generator=g)[: len(LK) * pages_a_row].reshape(len(LK), pages_a_row).to(torch.int32)
    lengths = torch.tensor(LK)
    table[(torch.arange(pages_a_row) * page)[None] >= lengths[:, None]] = 999  # past each row's keys: not read
    q, k_pages, v_pages = (x.requires_grad_(grad) for x in (q, k_pages, v_pages))
    out, lse, _ = fa.flash_attn_varlen_func(
        q, k_pages, v_pages, cu_q, cu_k, max(LQ), max(LK), causal=True, block_table=table, return_attn_probs=True,
        backend=backend,
    )  # fmt: skip
    parts = []
    for b in range(len(LQ)):
        rows = slice(cu_q[b], cu_q[b + 1])
        keys, values = (p[table[b].clamp(max=23).long()].flatten(0, 1)[: LK[b]] for p in (k_pages, v_pages))
        want, want_lse = reference(q[rows][None], keys[None], values[None], causal=True)
        torch.testing.assert_close(lse[:, rows].double(), want_lse[0].float().double(), rtol=1e-4, atol=1e-5)
        parts.append(want[0])
    want = torch.cat(parts)
    torch.testing.assert_close(out[: want.shape[0]].double(), want, rtol=1e-4, atol=1e-5)
    assert out[want.shape[0] :].abs().max() == 0
    if not grad:
        return
    got = torch.autograd.grad(out[: want.shape[0]].square().sum(), (q, k_pages, v_pages))
    expected = torch.autograd.grad(want.square().sum(), (q, k_pages, v_pages))
    for a, b in zip(got, expected):
        torch.testing.assert_close(a.double(), b.double(), rtol=1e-4, atol=1e-5)


def rotary_reference(x, cos, sin, positions, interleaved):
    """Rotary embedding written independently: complex products (GPT-J's pairs) or rotate-half (GPT-NeoX's)."""
    half = cos.shape[1]
    c, s = cos[positions][:, :, None], sin[positions][:, :, None]
    rot, rest = x[..., : 2 * half].double(), x[..., 2 * half :].double()
    if interleaved:
        turns = torch.complex(c.double(), s.double())
        pairs = torch.view_as_complex(rot.unflatten(-1, (half, 2)).contiguous())
        turned = torch.view_as_real(pairs * turns).flatten(-2)
    else:
        c2, s2 = torch.cat((c, c), -1).double(), torch.cat((s, s), -1).double()
        turned = rot * c2 + torch.cat((-rot[..., half:], rot[..., :half]), -1) * s2
    return torch.cat((turned, rest), -1)


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
@pytest.mark.parametrize("interleaved", [True, False], ids=["gptj", "neox"])
def test_a_decoding_step_appends_to_the_cache_and_attends(layout, interleaved, monkeypatch):
    """Three new tokens a row: rotated at their positions and written into the cache in place (through
    the page table where paged; through ``cache_batch_idx`` and after ``cache_leftpad`` where not),
    then attended causally with the rotated queries, as the reference attends the concatenation."""
    g = torch.Generator().manual_seed(7)
    new, lengths = 3, torch.tensor([10, 25], dtype=torch.int32)
    q = torch.randn(B, new, H, D, generator=g)
    k, v = (torch.randn(B, new, KV, D, generator=g) for _ in range(2))
    cos, sin = (torch.randn(64, 4, generator=g) for _ in range(2))  # a rotary dim of 8 of 16
    options = dict(cache_seqlens=lengths, causal=True, rotary_interleaved=interleaved, return_softmax_lse=True)
    starts = torch.zeros(B, dtype=torch.int32)
    if layout == "paged":
        monkeypatch.setattr(calls, "table_rows", None)  # the pages are read in place: a gather would fail
        table = torch.tensor([[3, 7, 1, 0], [5, 2, 9, 11]], dtype=torch.int32)
        k_cache, v_cache = (torch.randn(12, 8, KV, D, generator=g) for _ in range(2))
        before = [c[table.long()].flatten(1, 2).clone() for c in (k_cache, v_cache)]
        options["block_table"] = table
    else:
        k_cache, v_cache = (torch.randn(3, 40, KV, D, generator=g) for _ in range(2))
        picks, starts = torch.tensor([2, 0]), torch.tensor([4, 0], dtype=torch.int32)
        before = [c[picks].clone() for c in (k_cache, v_cache)]
        options.update(cache_batch_idx=picks.to(torch.int32), cache_leftpad=starts)
    out, lse = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cos, sin, backend="cpu", **options)
    after = [c[table.long()].flatten(1, 2) if layout == "paged" else c[picks] for c in (k_cache, v_cache)]
    for b in range(B):
        n, first = int(lengths[b]), int(starts[b])
        at = (n + torch.arange(new))[None]  # positions are cache indices, left padding included
        k_new = rotary_reference(k[b : b + 1], cos, sin, at, interleaved)[0]
        keys = torch.cat((before[0][b, first:n].double(), k_new))
        values = torch.cat((before[1][b, first:n].double(), v[b].double()))
        torch.testing.assert_close(after[0][b, first : n + new].double(), keys, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(after[1][b, : n + new].double()[first:], values)
        queries = rotary_reference(q[b : b + 1], cos, sin, at, interleaved)
        want, want_lse = reference(queries, keys[None], values[None], causal=True)
        torch.testing.assert_close(out[b : b + 1].double(), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse[b : b + 1].double(), want_lse.float().double(), rtol=1e-5, atol=1e-5)


def test_a_cache_without_new_keys_and_a_window():
    """``cache_seqlens`` alone (nothing appended; an int for every row), a window of 4 and soft-capping:
    each row attends the last of its keys."""
    q = torch.randn(B, 1, H, D, generator=torch.Generator().manual_seed(8))
    k_cache, v_cache = tensors(t=1, s=30, seed=9)[1:]
    out = fa.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=20, window_size=(4, 0), softcap=5.0)
    want = reference(q, k_cache[:, :20], v_cache[:, :20], window=(4, 0), softcap=5.0)[0]
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


def test_dropout_draws_a_new_mask_each_call_and_repeats_under_a_seed():
    q, k, v = tensors(seed=10)
    torch.manual_seed(0)
    first = call(q, k, v, backend="cpu", causal=True, dropout_p=0.3)
    torch.manual_seed(0)
    assert torch.equal(call(q, k, v, backend="cpu", causal=True, dropout_p=0.3), first)
    assert not torch.equal(call(q, k, v, backend="cpu", causal=True, dropout_p=0.3), first)
    assert not torch.allclose(first, call(q, k, v, backend="cpu", causal=True))


@TORCH_COMPILE
def test_under_torch_compile_fullgraph_with_dynamic_lengths():
    def layer(q, k, v, cu):
        whole = fa.flash_attn_func(q, k, v, causal=True, window_size=(5, 0), backend="interp")
        flat = fa.flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, cu, 0, 0, causal=True)
        return whole, flat.unflatten(0, q.shape[:2])

    compiled = torch.compile(layer, fullgraph=True, dynamic=True, backend="aot_eager")
    for length in (21, 17):
        q, k, v = tensors(length, length, seed=length, kv_heads=H)
        cu = torch.tensor([0, length, 2 * length], dtype=torch.int32)
        whole, flat = compiled(q, k, v, cu)
        torch.testing.assert_close(whole, layer(q, k, v, cu)[0])
        torch.testing.assert_close(flat.double(), reference(q, k, v, causal=True)[0], rtol=1e-4, atol=1e-5)


def test_what_cannot_be_computed_is_refused_by_name():
    q, k, v = tensors()
    with pytest.raises(NotImplementedError, match="return_attn_probs with dropout_p"):
        call(q, k, v, dropout_p=0.1, return_attn_probs=True)
    with pytest.raises(ValueError, match="window_size"):
        call(q, k, v, window=(-2, 0))
    with pytest.raises(ValueError, match=r"alibi_slopes must be \(4,\)"):
        call(q, k, v, slopes=torch.ones(3))
    with pytest.raises(TypeError, match="alibi_slopes must be float32"):
        call(q, k, v, slopes=SLOPES.double())
    with pytest.raises(ValueError, match="dividing q's 4"):
        call(q, k[:, :, :1].expand(-1, -1, 3, -1), v[:, :, :1].expand(-1, -1, 3, -1))
    with pytest.raises(ValueError, match=r"q must be a tensor \[B, T, H, D\]"):
        call(q[0], k, v)
    q, k, v, cu_q, cu_k = packed()
    with pytest.raises(TypeError, match="cu_seqlens_q must be int32"):
        fa.flash_attn_varlen_func(q, k, v, cu_q.long(), cu_k, 17, 17)
    with pytest.raises(ValueError, match="cu_seqlens_k is on meta"):
        fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k.to("meta"), 17, 17)
    with pytest.raises(ValueError, match="with block_table, k must be pages"):
        fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 17, 17, block_table=torch.zeros(4, 2, dtype=torch.int32))
    pages = k[:40].reshape(10, 4, KV, D)
    with pytest.raises(ValueError, match=r"block_table must be an int32 tensor \[4, pages a sequence\]"):
        fa.flash_attn_varlen_func(q, pages, pages, cu_q, cu_k, 17, 17, block_table=torch.zeros(3, 2, dtype=torch.int32))
    with pytest.raises(TypeError, match="block_table must be int32"):
        fa.flash_attn_varlen_func(q, pages, pages, cu_q, cu_k, 17, 17, block_table=torch.zeros(4, 5, dtype=torch.int64))
    q, k_cache, v_cache = tensors(t=1, s=30)
    with pytest.raises(ValueError, match="give k and v together"):
        fa.flash_attn_with_kvcache(q, k_cache, v_cache, k=k_cache[:, :1])
    with pytest.raises(ValueError, match="cache_seqlens must be an int or an int32 tensor of 2 rows"):
        fa.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=torch.tensor([3.0, 4.0]))


def test_a_padded_batch_unpadded_attends_as_its_sequences_and_pads_back():
    """``bert_padding``'s ``unpad_input`` and ``pad_input`` around ``flash_attn_varlen_func``: each row of a
    right-padded batch attends its own tokens; the padding comes back zeros; gradients flow through."""
    from attncomp.flash_attn.bert_padding import pad_input, unpad_input

    g = torch.Generator().manual_seed(11)
    hidden = torch.randn(B, 12, 3, H, D, generator=g, requires_grad=True)  # q, k and v of each position
    mask = torch.tensor([[1] * 12, [1] * 7 + [0] * 5])
    packed, indices, cu, longest, used = unpad_input(hidden, mask)
    assert packed.shape == (19, 3, H, D) and cu.tolist() == [0, 12, 19] and longest == 12 and used.tolist() == [12, 7]
    out = fa.flash_attn_varlen_qkvpacked_func(packed, cu, longest, causal=True, backend="interp")
    padded = pad_input(out, indices, B, 12)
    assert padded.shape == (B, 12, H, D) and padded[1, 7:].abs().max() == 0
    for b, n in enumerate((12, 7)):
        q, k, v = (hidden[b : b + 1, :n, i] for i in range(3))
        torch.testing.assert_close(padded[b : b + 1, :n].double(), reference(q, k, v, causal=True)[0])
    padded.sum().backward()
    assert hidden.grad[1, 7:].abs().max() == 0 and hidden.grad[1, :7].abs().max() > 0
    with pytest.raises(ValueError, match="attention_mask must be"):
        unpad_input(hidden, mask[:, :5])
