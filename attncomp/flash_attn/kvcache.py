"""``flash_attn_with_kvcache``: a decoding step (or a chunk of prefill) against a key/value cache.

The new keys and values, rotated where rotary tables are given, are written into the cache in place
at each row's length (``cache_seqlens``), through its page table where the cache is paged; then the
queries attend to the row's keys, ``cache_leftpad[b] <= j < cache_seqlens[b] + new``, aligned to the
last one (:func:`attncomp.flash_attn.specs.flash_attention_cache`).
"""

from __future__ import annotations

from typing import Any

import torch

from attncomp.flash_attn.calls import alibi_rows, check_heads, check_table, paged_keys, run
from attncomp.flash_attn.specs import flash_attention_cache, flash_attention_paged

WHERE = "flash_attn_with_kvcache"


def _per_row(value: Any, batch: int, default: int, name: str, device: Any) -> torch.Tensor:
    """An int32 ``[batch]`` tensor of ``value`` (None: ``default``; an int: every row's)."""
    if value is None or isinstance(value, int):
        return torch.full((batch,), default if value is None else value, dtype=torch.int32, device=device)
    if not isinstance(value, torch.Tensor) or value.shape != (batch,) or value.dtype.is_floating_point:
        raise ValueError(f"{WHERE}: {name} must be an int or an int32 tensor of {batch} rows; got {value!r}")
    return value.to(torch.int32)


def rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, interleaved: bool) -> Any:
    """``x`` ``[B, T, H, D]`` with its first ``2 * cos.shape[1]`` features rotated at ``positions`` ``[B, T]``:
    pairs ``(0, 1), (2, 3), ...`` where ``interleaved`` (GPT-J), else the two halves (GPT-NeoX)."""
    half = cos.shape[1]
    c, s = (t[positions][:, :, None].to(x.dtype) for t in (cos, sin))  # [B, T, 1, half]
    rot, rest = x[..., : 2 * half], x[..., 2 * half :]
    if interleaved:
        a, b = rot[..., 0::2], rot[..., 1::2]
        turned = torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)
    else:
        a, b = rot[..., :half], rot[..., half:]
        turned = torch.cat((a * c - b * s, a * s + b * c), dim=-1)
    return torch.cat((turned, rest), dim=-1)


def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    rotary_cos: torch.Tensor | None = None,
    rotary_sin: torch.Tensor | None = None,
    cache_seqlens: int | torch.Tensor | None = None,
    cache_batch_idx: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: torch.Tensor | None = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
    *,
    backend: str | None = None,
) -> Any:
    """``flash_attn.flash_attn_with_kvcache``: ``q`` ``[B, T, H, D]``; ``k_cache``, ``v_cache``
    ``[B_cache, S_cache, KV, D]``, or pages ``[num_pages, page_size, KV, D]`` with ``block_table``
    ``[B, pages a row]`` (int32); ``k``, ``v`` ``[B, new, KV, D]``, written into the cache at
    ``cache_seqlens`` (an int or ``[B]`` int32; default: the whole cache) before attending;
    ``rotary_cos``, ``rotary_sin`` ``[positions, rotary_dim / 2]`` rotate the new keys at their positions
    and the queries at theirs (all at the row's length unless ``causal`` or a window);
    ``cache_batch_idx`` picks each row's cache row; ``cache_leftpad`` ``[B]``: where each row's keys
    start. The masks, soft-cap and ALiBi are :func:`attncomp.flash_attn.flash_attn_func`'s, with
    ``S`` each row's length after the append. ``num_splits`` is accepted and not needed. Gives ``out``
    ``[B, T, H, D]``, and with ``return_softmax_lse`` ``(out, lse [B, H, T] float32)``."""
    check_heads(WHERE, q, k_cache, v_cache, 4)
    if (k is None) != (v is None):
        raise ValueError(f"{WHERE}: give k and v together (the new keys and values), or neither")
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError(f"{WHERE}: give rotary_cos and rotary_sin together, or neither")
    batch, device = q.shape[0], q.device
    paged = block_table is not None
    if paged:
        check_table(WHERE, block_table, batch, device)
        if cache_batch_idx is not None:
            raise ValueError(f"{WHERE}: cache_batch_idx picks rows of a contiguous cache; a paged one has block_table")
        capacity = block_table.shape[1] * k_cache.shape[1]
    else:
        capacity = k_cache.shape[1]
    lengths = _per_row(cache_seqlens, batch, capacity, "cache_seqlens", device)
    starts = _per_row(cache_leftpad, batch, 0, "cache_leftpad", device)
    rows = (
        torch.arange(batch, device=device) if cache_batch_idx is None else cache_batch_idx.to(torch.int64)
    )  # each row's cache row (contiguous caches)
    new = 0 if k is None else k.shape[1]
    if rotary_cos is not None:
        steps = torch.arange(max(new, q.shape[1]), device=device)
        base = lengths.to(torch.int64)[:, None]  # a row's index in the cache, left padding included (as FlashAttention)
        if k is not None:
            k = rotated(k, rotary_cos, rotary_sin, base + steps[:new], rotary_interleaved)
        moving = causal or tuple(window_size) != (-1, -1)
        at = base + (steps[: q.shape[1]] if moving else 0)
        q = rotated(q, rotary_cos, rotary_sin, at.expand(batch, q.shape[1]), rotary_interleaved)
    if k is not None:
        check_heads(WHERE, q, k, v, 4)
        positions = lengths.to(torch.int64)[:, None] + torch.arange(new, device=device)  # [B, new]
        with torch.no_grad():
            for cache, fresh in ((k_cache, k), (v_cache, v)):
                if paged:
                    size = k_cache.shape[1]
                    pages = block_table.to(torch.int64).gather(1, positions // size)
                    cache[pages, positions % size] = fresh.to(cache.dtype)
                else:
                    cache[rows[:, None], positions] = fresh.to(cache.dtype)
        lengths = lengths + new
    spec, slopes = flash_attention_cache, alibi_rows(WHERE, alibi_slopes, q, batch)
    if paged:  # read in place through the table, or (autograd recording) a copy of the pages read
        caches, in_place = paged_keys(k_cache, v_cache, block_table, lengths, q)
        spec = flash_attention_paged if in_place else spec
    elif cache_batch_idx is not None:
        caches = [k_cache[rows], v_cache[rows]]
    else:
        caches = [k_cache[:batch], v_cache[:batch]]
    result = run(
        WHERE, spec, [q, *caches, slopes, lengths, starts],
        dropout_p=0.0, softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
        alibi=alibi_slopes is not None, deterministic=False, lse=return_softmax_lse, backend=backend,
    )  # fmt: skip
    if not return_softmax_lse:
        return result
    out, lse = result
    return out, lse.float()
