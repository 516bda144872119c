"""``balance(fn, world, q, k, v, *captured)``: the layout that gives every rank the same live tiles."""

from __future__ import annotations

from typing import Any

import numpy as np

from attncomp.distributed.layout import CHUNKS_PER_RANK, Layout, choose, live_tiles
from attncomp.distributed.spec import FLOAT_TYPES, SpecParts, standin
from attncomp.ir.types import NUMPY_DTYPES, dtype_of_numpy

#: the most tiles along the sequence that :func:`balance` counts by default
MAX_BLOCKS = 256


def float_type(x: Any) -> str | None:
    """The spec float type of a numpy array or torch tensor (None if it is not a float)."""
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        return None
    name = str(dtype).removeprefix("torch.")
    if name in FLOAT_TYPES:
        return FLOAT_TYPES[name]
    found = dtype_of_numpy(np.dtype(dtype)) if not hasattr(x, "detach") else None
    return found if found in ("f16", "bf16", "f32", "f64") else None


def as_numpy(x: Any) -> np.ndarray:
    """A numpy array of a torch tensor's values (bf16 as ml_dtypes' bfloat16), or of any array."""
    if hasattr(x, "detach"):
        t = x.detach().cpu().contiguous()
        if str(t.dtype) == "torch.bfloat16":
            import torch

            return t.view(torch.int16).numpy().view(NUMPY_DTYPES["bf16"])
        return t.numpy()
    return np.asarray(x)


def whole_arguments(parts: SpecParts, args: tuple[Any, ...], length: int | None = None) -> dict[str, Any]:
    """Each argument by name as an array of its whole-sequence shape: stand-ins for q, k and v,
    the values of the others; given ``length`` (the tensors are shards), stand-ins of that many
    positions for every per-position argument."""
    if len(args) != len(parts.arguments):
        names = ", ".join(a.name for a in parts.arguments)
        raise TypeError(f"@{parts.member.name} takes {len(parts.arguments)} arguments ({names}), got {len(args)}")
    whole: dict[str, Any] = {}
    for arg, x in zip(parts.arguments, args):
        if arg.name in (parts.q, parts.k, parts.v) or length is not None and arg.seq_axis is not None:
            shape = list(x.shape)
            if length is not None and arg.seq_axis is not None:
                shape[arg.seq_axis] = length
            whole[arg.name] = standin(tuple(shape), arg.dtype)
        else:
            whole[arg.name] = as_numpy(x)
    return whole


def balance(
    fn: Any,
    world: int,
    *args: Any,
    chunks_per_rank: int | None = None,
    block: int | None = None,
) -> Layout:
    """The layout of the sequence over ``world`` ranks that balances their live tiles.

    ``args`` are the call's arguments over the whole sequence: q, k and v are read for their
    shapes only (any tensor or array of the right shape and type), captured tensors for their
    values (document ids, lengths).  ``chunks_per_rank`` fixes the number of chunks each rank
    holds (default: see :func:`attncomp.distributed.layout.choose`); ``block`` the tile size that
    counts work (default: the kernel's query block, larger for long sequences so that at most 256
    tiles lie along it, smaller where the chunks are).
    """
    if not isinstance(world, int) or world <= 0:
        raise ValueError(f"world: expected a positive number of ranks, got {world!r}")
    if chunks_per_rank is not None and (not isinstance(chunks_per_rank, int) or chunks_per_rank <= 0):
        raise ValueError(f"chunks_per_rank: expected a positive int, got {chunks_per_rank!r}")
    parts = SpecParts.of(fn, float_type(args[0]) if args else None)
    whole = whole_arguments(parts, args)
    length = whole[parts.q].shape[-2]
    if whole[parts.k].shape[-2] != length:
        raise ValueError(
            f"{parts.k}: context parallelism shards queries and keys alike, so their lengths must agree, "
            f"got {length} queries and {whole[parts.k].shape[-2]} keys"
        )
    counts = [chunks_per_rank] if chunks_per_rank is not None else list(CHUNKS_PER_RANK)
    fitting = [c for c in counts if length % (world * c) == 0]
    if not fitting:
        raise ValueError(f"length {length} is not a multiple of {world} ranks x {counts[0]} chunks")
    if block is None:
        block_q = next((p.block_q for p in parts.member.passes if p.name == "flash-tiling"), 64)
        # at most MAX_BLOCKS tiles along the sequence: the classification runs tile by tile
        block = max(block_q, length // MAX_BLOCKS)
        block = int(np.gcd(block, length // (world * max(fitting))))
    elif not isinstance(block, int) or block <= 0:
        raise ValueError(f"block: expected a positive int, got {block!r}")
    return choose(live_tiles(parts.tiles(whole, block)), block, world, length, chunks_per_rank)
