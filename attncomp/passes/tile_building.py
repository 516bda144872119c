"""What flash-tiling's forward and backward loop nests are built from: grid indices, tile
loads, position tiles and regions retyped to the accumulation type."""

from __future__ import annotations

from attncomp.ir.core import Block, Value
from attncomp.ir.dims import Dim, dim
from attncomp.ir.types import TensorType
from attncomp.passes.builder import Builder, inline_region

BATCH_NAMES = {0: [], 1: ["b"], 2: ["b", "h"]}


def named(value: Value, name: str) -> Value:
    value.name = name
    return value


def grid_region(n_batch: int, start: str) -> tuple[Block, list[Value], Value]:
    """A grid's region: one i64 index per batch axis (``b``, ``h``), then the block's first row ``start``."""
    grid = Block()
    names = BATCH_NAMES.get(n_batch, [f"b{k}" for k in range(n_batch)])
    grid_index = [grid.add_arg(TensorType((), "i64"), n) for n in names]
    return grid, grid_index, grid.add_arg(TensorType((), "i64"), start)


def kv_head_of(builder: Builder, grid_index: list[Value], kv_repeat: Dim) -> Value | None:
    """``h // kv_repeat`` with grouped-query attention, else None."""
    if kv_repeat == dim(1):
        return None
    return named(builder.emit("ac.floordiv", grid_index[1], builder.dim(kv_repeat)), "kv_head")


def batch_indices(builder: Builder, operand: Value, grid_index: list[Value], kv_head: Value | None) -> list[Value]:
    """The batch indices of ``operand`` for the grid position (broadcast axes read 0)."""
    rank = operand.type.rank - 2
    offset = len(grid_index) - rank
    out = []
    for axis in range(rank):
        d = operand.type.shape[axis]
        if d.is_const and d.value == 1:
            out.append(builder.const(0, "i64"))
        elif kv_head is not None and axis + offset == 1:
            out.append(kv_head)
        else:
            out.append(grid_index[axis + offset])
    return out


def load_rows(
    builder: Builder, src: Value, grid_index: list[Value], kv_head: Value | None, row0: Value, rows: int, acc: str
) -> Value:
    """Rows ``row0 ..`` of ``src`` at the grid position, as a tile in the accumulation type."""
    indices = batch_indices(builder, src, grid_index, kv_head)
    return builder.cast(builder.op("ac.tile_load", [src, *indices, row0], {"rows": rows}).result, acc)


def positions(builder: Builder, start: Value, block: int, axis: int, length) -> tuple[Value, Value]:
    """(start + arange(block) along ``axis``, the same clamped to ``length - 1``)."""
    shape = (block, 1) if axis == 0 else (1, block)
    ramp = builder.op("ac.iota", [], {"axis": axis}, [TensorType.of(shape, "i64")]).result
    raw = builder.emit("ac.add", start, ramp)
    return raw, builder.emit("ac.minimum", raw, builder.dim(length - 1))


def retyped_region(region: Block, arg_types: list[TensorType], dtypes: list[str | None]) -> Block:
    """``region`` with new argument types, its k-th yield cast to ``dtypes[k]`` (None: as it is)."""
    block = Block()
    args = [block.add_arg(t, a.name) for t, a in zip(arg_types, region.args)]
    builder = Builder(block)
    results = inline_region(builder, region, args)
    builder.yield_(*(r if d is None else builder.cast(r, d) for r, d in zip(results, dtypes)))
    return block
