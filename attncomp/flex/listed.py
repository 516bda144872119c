"""Block masks made from lists of blocks (``BlockMask.from_kv_blocks``): the mask they stand for.

FlexAttention's block mask lists, per (batch, head, query block), the key blocks it computes: the
partial ones (``kv_num_blocks`` of ``kv_indices``), where ``mask_mod`` decides each entry, and the
full ones (``full_kv_num_blocks`` of ``full_kv_indices``), shown whole; a block in neither list is
hidden.  A mask from ``create_block_mask`` lists what its ``mask_mod`` shows, so that function alone
is its mask (what attncomp compiles, each tile classified from its expression).  A mask made from
lists is its lists: :func:`listed_mask_mod` gives the mask function that says so, reading one int32
code per block (0 hidden, 1 partial, 2 full) from a table the compiled spec captures, as any
``mask_mod`` reads a tensor; with torch's ``noop_mask`` (a list with no function), every listed
block is shown whole.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from attncomp.flex.recording import Probe

HIDDEN, PARTIAL, FULL = 0, 1, 2


def _four_dims(x: torch.Tensor, name: str, extra: int) -> torch.Tensor:
    """``x`` as ``[B, H, query blocks(, slots)]``: leading axes of 1 where it has fewer."""
    want = 3 + extra
    if x.dim() > want or x.dim() < 1 + extra:
        raise ValueError(f"from_kv_blocks: {name} has {x.dim()} axes; it is [B, H, query blocks{', slots' * extra}]")
    return x.reshape((1,) * (want - x.dim()) + tuple(x.shape))


def block_codes(
    kv_num_blocks: torch.Tensor,
    kv_indices: torch.Tensor,
    full_kv_num_blocks: torch.Tensor | None,
    full_kv_indices: torch.Tensor | None,
    kv_blocks: int,
) -> torch.Tensor:
    """int32 ``[B, H, query blocks, kv_blocks]``: each block's code, from the lists (a block in both
    lists is full)."""
    lists = [(kv_num_blocks, kv_indices, PARTIAL)]
    if full_kv_num_blocks is not None:
        lists.append((full_kv_num_blocks, full_kv_indices, FULL))
    shapes = [_four_dims(i, "kv_indices", 1).shape[:3] for _, i, _ in lists]
    batch, heads, rows = (max(s[a] for s in shapes) for a in range(3))
    codes = torch.zeros(batch, heads, rows, kv_blocks, dtype=torch.int32, device=kv_indices.device)
    for count, indices, code in lists:
        count, indices = _four_dims(count, "kv_num_blocks", 0), _four_dims(indices, "kv_indices", 1)
        used = torch.arange(indices.shape[-1], device=indices.device) < count[..., None].to(indices.device)
        used &= (indices >= 0) & (indices < kv_blocks)  # a block past the keys has none to show
        slot = torch.where(used, indices.long(), kv_blocks).expand(batch, heads, rows, -1)  # unused: a spare column
        listed = torch.zeros(batch, heads, rows, kv_blocks + 1, dtype=torch.int32, device=codes.device)
        listed.scatter_(-1, slot, code)
        codes = torch.maximum(codes, listed[..., :kv_blocks])
    return codes


def listed_mask_mod(codes: torch.Tensor, block_size: tuple[int, int], mask_mod: Callable | None) -> Callable:
    """The mask of the block ``codes``: a full block shown whole, a partial one where ``mask_mod``
    shows an entry (``None``: whole), the others hidden.  A batch or heads axis of 1 is shared."""
    rows, cols = block_size
    shared = [codes.shape[0] == 1, codes.shape[1] == 1]
    table = codes[:, 0] if shared[1] else codes
    table = table[0] if shared[0] else table

    def listed(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        picked = [x for x, one in zip((b, h), shared) if not one]
        key = (*picked, q_idx // rows, kv_idx // cols)
        if isinstance(q_idx, Probe):  # recorded as the table's entry, no torch op on it (it may be traced)
            code = q_idx.recording.apply("index", table, *key)
        else:
            code = table[key]
        if mask_mod is None:
            return code > HIDDEN
        return (code == FULL) | ((code == PARTIAL) & mask_mod(b, h, q_idx, kv_idx))

    return listed
