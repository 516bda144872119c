"""FlashAttention's functions, computed by attncomp: the same arguments, one import to swap.

    from attncomp.flash_attn import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

    out = flash_attn_func(q, k, v, causal=True, window_size=(256, 0), softcap=30.0)

``flash_attn_func`` (and its ``qkvpacked`` / ``kvpacked`` forms) takes ``[B, T, H, D]`` tensors,
``flash_attn_varlen_func`` (and its packed forms) sequences packed along the positions with their
``cu_seqlens``, ``flash_attn_with_kvcache`` a decoding step against a key/value cache, contiguous or
paged, which it appends to in place.  Causal attention, sliding windows, soft-capping, ALiBi
slopes, grouped- and multi-query heads, dropout and the log-sum-exp, as FlashAttention defines
them (:mod:`attncomp.flash_attn.specs`); each call compiles one of three specs once per constants
and backend and runs its torch op: differentiable, CPU tensors on ``cpu`` (where FlashAttention
does not run), CUDA tensors on ``cuda``, float32 too.

Where it differs: the dropout mask is attncomp's hash of the positions, not FlashAttention's
Philox; a query that sees no key gets zeros and a log-sum-exp of ``-inf``; ``return_attn_probs``
gives the log-sum-exp and an empty tensor (FlashAttention's ``S_dmask`` when nothing is dropped), and
is refused with dropout (the dropped-out probabilities are a ``[B, H, T, S]`` matrix attncomp never
forms).  A paged cache (``flash_attn_with_kvcache``'s, or ``flash_attn_varlen_func``'s with a
``block_table``) is read in place through the table (``ac.page_view``), except where autograd
records the call: then the pages read are gathered into rows, which torch differentiates.
It needs the ``torch`` extra; ``import attncomp`` does not import this module (nor torch).
"""

from __future__ import annotations

from typing import Any

import torch

from attncomp.flash_attn.calls import (
    alibi_rows,
    check_heads,
    check_table,
    paged_keys,
    refuse_probabilities,
    run,
    with_probabilities,
)
from attncomp.flash_attn.kvcache import flash_attn_with_kvcache
from attncomp.flash_attn.specs import flash_attention, flash_attention_varlen, flash_attention_varlen_paged

__all__ = [
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
]


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    backend: str | None = None,
) -> Any:
    """``flash_attn.flash_attn_func``: ``q`` ``[B, T, H, D]``, ``k`` ``[B, S, KV, D]``, ``v`` ``[B, S, KV, Dv]``
    (``KV`` dividing ``H``); queries aligned to the last key (``causal`` hides key ``j > i + S - T``);
    ``window_size=(left, right)`` shows keys ``i + S - T - left <= j <= i + S - T + right`` (-1: no bound);
    ``softcap`` caps the scaled scores (``softcap * tanh(s / softcap)``); ``alibi_slopes`` ``[H]`` or
    ``[B, H]`` float32 adds ``-slope * |i + S - T - j|``.  Gives ``out`` ``[B, T, H, Dv]``, and with
    ``return_attn_probs`` ``(out, lse [B, H, T] float32, an empty tensor)``.  ``backend``: "cpu", "cuda"
    or "interp" (default: the tensors' device's)."""
    check_heads("flash_attn_func", q, k, v, 4)
    refuse_probabilities("flash_attn_func", return_attn_probs, dropout_p)
    slopes = alibi_rows("flash_attn_func", alibi_slopes, q, q.shape[0])
    result = run(
        "flash_attn_func", flash_attention, [q, k, v, slopes],
        dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
        alibi=alibi_slopes is not None, deterministic=deterministic, lse=return_attn_probs, backend=backend,
    )  # fmt: skip
    return with_probabilities(*result) if return_attn_probs else result


def flash_attn_kvpacked_func(q: torch.Tensor, kv: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """``flash_attn.flash_attn_kvpacked_func``: ``kv`` ``[B, S, 2, KV, D]``; the rest as :func:`flash_attn_func`."""
    if kv.dim() != 5 or kv.shape[2] != 2:
        raise ValueError(f"flash_attn_kvpacked_func: kv must be [B, S, 2, KV, D]; got {tuple(kv.shape)}")
    return flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], *args, **kwargs)


def flash_attn_qkvpacked_func(qkv: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """``flash_attn.flash_attn_qkvpacked_func``: ``qkv`` ``[B, T, 3, H, D]``; the rest as :func:`flash_attn_func`."""
    if qkv.dim() != 5 or qkv.shape[2] != 3:
        raise ValueError(f"flash_attn_qkvpacked_func: qkv must be [B, T, 3, H, D]; got {tuple(qkv.shape)}")
    return flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], *args, **kwargs)


def _check_offsets(cu_seqlens: Any, name: str, device: torch.device) -> None:
    """Refuse, by name, offsets that are not a 1-D int32 tensor of batch + 1 on ``device``."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
        raise ValueError(f"flash_attn_varlen_func: {name} must be a 1-D tensor of batch + 1 offsets")
    if cu_seqlens.device != device:
        raise ValueError(f"flash_attn_varlen_func: {name} is on {cu_seqlens.device}, the tensors on {device}")
    if cu_seqlens.dtype != torch.int32:
        raise TypeError(
            f"flash_attn_varlen_func: {name} must be int32, as FlashAttention takes it; got {cu_seqlens.dtype}"
        )


def _sequences(cu_seqlens: Any, total: int, name: str, device: torch.device) -> torch.Tensor:
    """Each packed position's sequence (``len(cu_seqlens) - 1`` past the last one)."""
    _check_offsets(cu_seqlens, name, device)
    positions = torch.arange(total, dtype=torch.int32, device=cu_seqlens.device)
    return torch.searchsorted(cu_seqlens[1:], positions, right=True).to(torch.int32)


def _paged_rows(
    where: str, k_pages: torch.Tensor, v_pages: torch.Tensor, block_table: Any, cu_seqlens_k: Any, q: torch.Tensor
) -> tuple[list[torch.Tensor], bool, torch.Tensor, torch.Tensor]:
    """The keys and values of a paged call as rows ``b * capacity + p`` (capacity: the table's pages a
    sequence times the page size; :func:`calls.paged_keys`: the pages and the table's rows one after
    another, read in place, or a copy of the pages read) and whether in place; the end of each
    sequence's keys in those rows, and each row's sequence (``batch + 1`` past its keys)."""
    device, batch = k_pages.device, cu_seqlens_k.shape[0] - 1
    check_table(where, block_table, batch, device)
    _check_offsets(cu_seqlens_k, "cu_seqlens_k", device)
    capacity = block_table.shape[1] * k_pages.shape[1]
    lengths = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).to(torch.int64)
    keys, in_place = paged_keys(k_pages, v_pages, block_table, lengths, q)
    keys = [*keys[:2], keys[2].flatten()] if in_place else [rows.flatten(0, 1)[None] for rows in keys]
    starts = torch.arange(batch, device=device) * capacity
    row_sequence = torch.arange(batch * capacity, device=device) // capacity
    inside = torch.arange(batch * capacity, device=device) % capacity < lengths[row_sequence]
    k_seq = torch.where(inside, row_sequence, batch + 1).to(torch.int32)
    return keys, in_place, starts + lengths, k_seq


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: torch.Tensor | None = None,
    *,
    backend: str | None = None,
) -> Any:
    """``flash_attn.flash_attn_varlen_func``: ``q`` ``[total_q, H, D]``, ``k`` and ``v`` ``[total_k, KV, D]``,
    sequence ``b`` at ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` (int32) of ``q`` and likewise of ``k``; each
    query sees its own sequence's keys, aligned to its last key, with the masks of :func:`flash_attn_func`.
    Positions past the last offset take part in nothing.  With ``block_table`` ``[batch, pages a
    sequence]`` (int32), ``k`` and ``v`` are pages ``[num_pages, page_size, KV, D]`` and sequence ``b``'s
    keys its first ``cu_seqlens_k[b + 1] - cu_seqlens_k[b]`` positions through its row of the table (a
    prefill chunk against a paged cache, read in place).
    ``max_seqlen_q`` and ``max_seqlen_k`` are accepted and not needed.  Gives ``out`` ``[total_q, H,
    Dv]``, and with ``return_attn_probs`` ``(out, lse [H, total_q] float32, an empty tensor)``."""
    where = "flash_attn_varlen_func"
    paged = block_table is not None
    if paged:
        for name, x in (("k", k), ("v", v)):
            if not isinstance(x, torch.Tensor) or x.dim() != 4:
                raise ValueError(f"{where}: with block_table, {name} must be pages [num_pages, page_size, KV, D]")
        check_heads(where, q, k.flatten(0, 1), v.flatten(0, 1), 3)
    else:
        check_heads(where, q, k, v, 3)
    refuse_probabilities(where, return_attn_probs, dropout_p)
    if cu_seqlens_q.shape != getattr(cu_seqlens_k, "shape", None):
        raise ValueError(f"{where}: cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1)")
    batch = cu_seqlens_q.shape[0] - 1
    q_seq = _sequences(cu_seqlens_q, q.shape[0], "cu_seqlens_q", q.device)
    spec = flash_attention_varlen
    if paged:  # sequence b's keys at rows b * capacity + p, p < its length; the rows past them no query's
        keys, in_place, k_ends, k_seq = _paged_rows(where, k, v, block_table, cu_seqlens_k, q)
        spec = flash_attention_varlen_paged if in_place else spec
    else:
        k_seq = _sequences(cu_seqlens_k, k.shape[0], "cu_seqlens_k", q.device)
        k_seq = torch.where(k_seq == batch, batch + 1, k_seq)  # keys past the last sequence: no query's
        keys, k_ends = [k[None], v[None]], cu_seqlens_k[1:]
    # a query's shift: its sequence's (S - T) + (where its keys start - where its queries start)
    ends = (k_ends - cu_seqlens_q[1:]).to(torch.int32)
    q_shift = ends[q_seq.clamp(max=batch - 1)]
    slopes = alibi_rows(where, alibi_slopes, q, batch)
    result = run(
        where, spec, [q[None], *keys, slopes, q_seq, k_seq, q_shift],
        dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
        alibi=alibi_slopes is not None, deterministic=deterministic, lse=return_attn_probs, backend=backend,
    )  # fmt: skip
    if not return_attn_probs:
        return result[0]
    out, lse = result
    return with_probabilities(out[0], lse[0])


def flash_attn_varlen_kvpacked_func(
    q: torch.Tensor, kv: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, *args: Any, **kwargs: Any
) -> Any:
    """``flash_attn.flash_attn_varlen_kvpacked_func``: ``kv`` ``[total_k, 2, KV, D]``; the rest as
    :func:`flash_attn_varlen_func`."""
    if kv.dim() != 4 or kv.shape[1] != 2:
        raise ValueError(f"flash_attn_varlen_kvpacked_func: kv must be [total_k, 2, KV, D]; got {tuple(kv.shape)}")
    return flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], cu_seqlens_q, cu_seqlens_k, *args, **kwargs)


def flash_attn_varlen_qkvpacked_func(
    qkv: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, *args: Any, **kwargs: Any
) -> Any:
    """``flash_attn.flash_attn_varlen_qkvpacked_func``: ``qkv`` ``[total, 3, H, D]``, one ``cu_seqlens``; the
    rest as :func:`flash_attn_varlen_func`."""
    if qkv.dim() != 4 or qkv.shape[1] != 3:
        raise ValueError(f"flash_attn_varlen_qkvpacked_func: qkv must be [total, 3, H, D]; got {tuple(qkv.shape)}")
    q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, *args, **kwargs)
