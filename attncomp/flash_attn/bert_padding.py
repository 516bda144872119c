"""``flash_attn.bert_padding``'s helpers: a padded batch to packed sequences and back, for
:func:`attncomp.flash_attn.flash_attn_varlen_func` (plain torch indexing, differentiable).

    x, indices, cu_seqlens, max_seqlen, used = unpad_input(hidden, attention_mask)
    out = flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, causal=True)
    hidden = pad_input(out, indices, batch, seqlen)
"""

from __future__ import annotations

import torch

__all__ = ["index_first_axis", "index_put_first_axis", "pad_input", "unpad_input"]


def index_first_axis(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``x[indices]`` along the first axis (its rows picked, the rest of each row as it is)."""
    return x.index_select(0, indices)


def index_put_first_axis(values: torch.Tensor, indices: torch.Tensor, first_axis_dim: int) -> torch.Tensor:
    """Zeros of ``first_axis_dim`` rows, ``values`` at ``indices``: :func:`index_first_axis` undone."""
    out = values.new_zeros((first_axis_dim, *values.shape[1:]))
    return out.index_copy(0, indices, values)


def unpad_input(
    hidden_states: torch.Tensor, attention_mask: torch.Tensor, unused_mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, torch.Tensor]:
    """``hidden_states`` ``[B, S, ...]`` packed to the positions ``attention_mask`` ``[B, S]`` keeps (and
    ``unused_mask``'s too: positions packed but not counted as used): ``(packed [total, ...], indices
    [total] of the kept positions in the flattened batch, cu_seqlens [B + 1] int32, the longest
    sequence, the used positions of each sequence [B] int32)``."""
    if attention_mask.dim() != 2 or tuple(attention_mask.shape) != tuple(hidden_states.shape[:2]):
        raise ValueError(
            f"unpad_input: attention_mask must be [B, S] = {list(hidden_states.shape[:2])}; got "
            f"{list(attention_mask.shape)}"
        )
    kept = attention_mask.bool() if unused_mask is None else attention_mask.bool() | unused_mask.bool()
    lengths = kept.sum(dim=-1, dtype=torch.int32)
    used = attention_mask.bool().sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(kept.flatten(), as_tuple=False).flatten()
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(lengths, dim=0, dtype=torch.int32), (1, 0))
    packed = index_first_axis(hidden_states.flatten(0, 1), indices)
    return packed, indices, cu_seqlens, int(lengths.max().item()) if lengths.numel() else 0, used


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """Packed rows ``[total, ...]`` back to ``[batch, seqlen, ...]``, zeros where nothing was packed."""
    return index_put_first_axis(hidden_states, indices, batch * seqlen).unflatten(0, (batch, seqlen))
