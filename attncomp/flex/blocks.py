"""A block mask's blocks, evaluated on demand: what ``BlockMask.sparsity()``, ``to_dense()`` and
``to_string()`` report, as FlexAttention's do.

attncomp's kernels never evaluate a mask (mask-elimination classifies each tile from ``mask_mod``'s
expression), so these are for a user who asks: the mask function is called on a block of query
rows at a time, with index tensors that broadcast (``b [B, 1, 1, 1]``, ``h [1, H, 1, 1]``, ``q_idx
[1, 1, rows, 1]``, ``kv_idx [1, 1, 1, KV_LEN]``), and each ``BLOCK_SIZE`` block reduced to whether
any of its entries is shown (a block FlexAttention computes).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch


def visible_blocks(
    mask_mod: Callable,
    batch: int,
    heads: int,
    q_len: int,
    kv_len: int,
    block_size: tuple[int, int],
    device: Any,
    q_blocks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Bool ``[batch, heads, query blocks, key blocks]``: the blocks with an entry shown (of the query
    blocks ``q_blocks`` only, where given)."""
    rows, cols = block_size
    kv_blocks = -(-kv_len // cols)
    numbers = range(-(-q_len // rows)) if q_blocks is None else [int(n) for n in q_blocks]
    some = torch.zeros(batch, heads, len(numbers), kv_blocks, dtype=torch.bool, device=device)
    b = torch.arange(batch, device=device)[:, None, None, None]
    h = torch.arange(heads, device=device)[None, :, None, None]
    kv_idx = torch.arange(kv_len, device=device)[None, None, None, :]
    pad = kv_blocks * cols - kv_len
    for at, n in enumerate(numbers):
        q_idx = torch.arange(n * rows, min((n + 1) * rows, q_len), device=device)[None, None, :, None]
        shown = torch.as_tensor(mask_mod(b, h, q_idx, kv_idx), device=device)
        shown = shown.to(torch.bool).expand(batch, heads, q_idx.shape[2], kv_len)
        blocked = torch.nn.functional.pad(shown, (0, pad)).unflatten(-1, (kv_blocks, cols))
        some[:, :, at] = blocked.any(-1).any(2)
    return some


def sparsity(computed: torch.Tensor, block_size: tuple[int, int], q_len: int, kv_len: int) -> float:
    """The percentage of the ``[B, H, Q_LEN, KV_LEN]`` scores in blocks not ``computed``, counting each
    computed block whole, as FlexAttention's ``BlockMask.sparsity()``."""
    total = computed.shape[0] * computed.shape[1] * q_len * kv_len
    return 100.0 * (1.0 - int(computed.sum()) * block_size[0] * block_size[1] / total) if total else 0.0


def pick(index: Any, size: int, axis: str) -> range | torch.Tensor:
    """The positions a block mask index picks of an axis of ``size``: a range (an int ``i``: ``i:i + 1``,
    kept as an axis of 1, as FlexAttention keeps it; a slice) or an int64 tensor (a 1-D index or
    boolean tensor)."""
    if isinstance(index, int) and not isinstance(index, bool):
        if not -size <= index < size:
            raise IndexError(f"BlockMask: index {index} is out of range for the {axis} ({size})")
        return range(index % size, index % size + 1)
    if isinstance(index, slice):
        return range(size)[index]
    if isinstance(index, torch.Tensor) and index.dim() == 1:
        if index.dtype == torch.bool:
            if len(index) != size:
                raise IndexError(f"BlockMask: a boolean index of the {axis} needs {size} entries, got {len(index)}")
            return index.cpu().nonzero()[:, 0]
        picked = index.cpu().to(torch.int64)
        if len(picked) and not bool(((picked >= -size) & (picked < size)).all()):
            raise IndexError(f"BlockMask: an index of the {axis} is out of range ({size})")
        return picked % size
    raise IndexError(f"BlockMask: index the {axis} with an int, a slice or a 1-D tensor; got {index!r}")


def positions(picked: range | torch.Tensor) -> torch.Tensor:
    """The positions ``picked`` (:func:`pick`) as int64."""
    return torch.tensor(list(picked), dtype=torch.int64) if isinstance(picked, range) else picked


def remapped(mask_mod: Callable, batch: range | torch.Tensor, heads: range | torch.Tensor) -> Callable:
    """``mask_mod`` of the batch entries and heads picked (:func:`pick`): batch ``b`` of the new mask is
    ``start + step * b`` of the old (a range), or ``index[b]`` (a tensor, read as a captured one)."""

    def at(picked: range | torch.Tensor, position: Any) -> Any:
        if isinstance(picked, range):
            return position if (picked.start, picked.step) == (0, 1) else picked.start + picked.step * position
        return picked.to(position.device)[position] if isinstance(position, torch.Tensor) else picked[position]

    def picked_mask(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return mask_mod(at(batch, b), at(heads, h), q_idx, kv_idx)

    picked_mask.__name__ = getattr(mask_mod, "__name__", "mask_mod")
    return picked_mask


def picture(dense: torch.Tensor, grid_size: int | tuple[int, int] = (20, 20), limit: int = 4) -> str:
    """``BlockMask.to_string()``: per (batch, head), up to ``limit`` of them, the blocks at most
    ``grid_size`` characters a side: "█" where every block of a cell is computed, " " where none,
    "░" between (``grid_size`` -1: a character per block)."""
    *batch, n_rows, n_cols = dense.shape
    if grid_size == -1:
        most_rows, most_cols = n_rows, n_cols
    elif isinstance(grid_size, int):
        most_rows = most_cols = grid_size
    else:
        most_rows, most_cols = grid_size
    row_step, col_step = max(1, -(-n_rows // most_rows)), max(1, -(-n_cols // most_cols))
    parts = []
    for count, index in enumerate(itertools.product(*(range(n) for n in batch))):
        if count == limit:
            parts.append("...\nTo print out more, set BlockMask.to_string(limit=N)")
            parts.append("You can also index (BlockMask[batch, head]) to choose a specific batch or head")
            break
        blocks = dense[index].float()
        lines = [f"{index}"]
        for r in range(0, n_rows, row_step):
            cells = [blocks[r : r + row_step, c : c + col_step].mean().item() for c in range(0, n_cols, col_step)]
            lines.append("".join(("█" if x == 1 else " " if x == 0 else "░") * 2 for x in cells))
        parts.append("\n".join(lines) + "\n")
    return "\n".join(parts)
