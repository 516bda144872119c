"""Tile-level ops that flash-tiling and mask-elimination produce.

    %o, %lse = ac.tile_grid {block_q = 64} : tensor<B x H x T x E x f32>, tensor<B x H x T x f32> ({
    ^bb0(%b: tensor<i64>, %h: tensor<i64>, %i0: tensor<i64>):
      %qt = ac.tile_load %q, %b, %h, %i0 {rows = 64} : tensor<64 x D x f32>
      %m, %l, %acc = ac.tile_for %lo, %hi, %m0, %l0, %acc0 : ... ({
      ^bb0(%kb: tensor<i64>, %m_i: ..., %l_i: ..., %acc_i: ...):
        ...
        ac.yield %m_n, %l_n, %acc_n
      })
      ac.yield %o_tile, %lse_tile
    })
    %s2 = ac.map %b, %h, %i, %j, %s {role = "score"} : tensor<64 x 64 x f32> ({...})
    %r = ac.switch %class {tile_class = true} : ... ({ skipped }, { masked }, { full })

Tiles have the static block size; a tile at the end of a sequence is padded
(zero rows on load, rows past the end dropped on store).
"""

from __future__ import annotations

import itertools

import numpy as np

from attncomp.errors import TypeCheckError
from attncomp.ir.dims import dim
from attncomp.ir.ops.base import OpDef, register, require_attr
from attncomp.ir.types import TensorType, is_int

INDEX = TensorType((), "i64")


def _yield_types(block) -> list[TensorType]:
    return [v.type for v in block.ops[-1].operands]


def _region_count(op, n: int, what: str) -> None:
    if len(op.regions) != n:
        raise TypeCheckError(f"{what}: needs {n} region(s), got {len(op.regions)}")


def _index_operands(types: list[TensorType], what: str) -> None:
    for t in types:
        if t.rank != 0 or not is_int(t.dtype):
            raise TypeCheckError(f"{what}: index operands must be 0-d integers, got {t}")


@register
class TileGrid(OpDef):
    """Run the region once per batch position and block of ``block_q`` rows.

    The region gets one index per batch axis and the first row ``i0`` and
    yields one tile per result (``block_q`` rows, the result's trailing
    axes); rows past the end of the sequence are dropped.
    """

    name = "ac.tile_grid"
    num_operands = 0
    declared_result = True
    attributes = {
        "block_q": "rows per block",
        "kv_repeat": "query heads per key/value head (GQA), for backends that group them",
    }

    def infer(self, operands, attrs, declared, checker):
        block_q = require_attr(attrs, "block_q", int, self.name)
        if block_q <= 0:
            raise TypeCheckError(f"{self.name}: block_q must be positive")
        if operands:
            raise TypeCheckError(f"{self.name}: takes no operands")
        if not declared:
            raise TypeCheckError(f"{self.name}: needs declared result types")
        rows = declared[0].rank - 1
        if rows < 1:
            raise TypeCheckError(f"{self.name}: the first result needs rank >= 2")
        for t in declared:
            if t.rank < rows or t.shape[:rows] != declared[0].shape[:rows]:
                raise TypeCheckError(f"{self.name}: results must share batch axes and rows")
        return declared

    @staticmethod
    def tile_type(result: TensorType, batch_rank: int, block_q: int) -> TensorType:
        return result.with_shape((dim(block_q),) + result.shape[batch_rank + 1 :])

    def verify_regions(self, op) -> None:
        _region_count(op, 1, self.name)
        batch_rank = self.batch_rank(op)
        region = op.regions[0]
        if [a.type for a in region.args] != [INDEX] * (batch_rank + 1):
            raise TypeCheckError(f"{self.name}: the region takes {batch_rank + 1} i64 indices")
        want = [self.tile_type(r.type, batch_rank, op.attrs["block_q"]) for r in op.results]
        if _yield_types(region) != want:
            raise TypeCheckError(f"{self.name}: the region must yield {', '.join(map(str, want))}")

    @staticmethod
    def batch_rank(op) -> int:
        """Batch axes: those before the row axis of the first result ([*batch, T, E])."""
        return op.results[0].type.rank - 2

    def evaluate(self, op, args, ctx):
        block_q = op.attrs["block_q"]
        batch_rank = self.batch_rank(op)
        shapes = [r.type.concrete_shape(ctx.env) for r in op.results]
        outputs = [np.zeros(s, dtype=np.float64) for s in shapes]
        rows = shapes[0][batch_rank]
        for position in itertools.product(*(range(n) for n in shapes[0][:batch_rank])):
            for i0 in range(0, rows, block_q):
                if ctx.recorder is not None:
                    grid_shape = tuple(shapes[0][:batch_rank]) + (-(-rows // block_q),)
                    ctx.recorder.enter_query_block(op, position, i0 // block_q, grid_shape)
                index = [np.asarray(p, dtype=np.int64) for p in position] + [np.asarray(i0, dtype=np.int64)]
                tiles = ctx.run_block(op.regions[0], index)
                n = min(block_q, rows - i0)
                for out, tile in zip(outputs, tiles):
                    out[position + (slice(i0, i0 + n),)] = np.asarray(tile)[:n]
        return outputs


@register
class TileFor(OpDef):
    """``for it in range(lo, hi)`` carrying values: operands ``lo, hi, init...``.

    The region gets ``it`` and the carried values and yields their next values.
    Key-block loops carry ``block_k``, their full ``extent`` in blocks, and
    ``tile_class = 2`` when no tile needs a mask.
    """

    name = "ac.tile_for"
    attributes = {
        "block_k": "keys per block",
        "extent": "number of key blocks before bounds were tightened",
        "tile_class": "2 when every tile is full (no mask)",
    }

    def infer(self, operands, attrs, declared, checker):
        if len(operands) < 2:
            raise TypeCheckError(f"{self.name}: needs lo, hi and carried values")
        _index_operands(operands[:2], self.name)
        return list(operands[2:])

    def verify_regions(self, op) -> None:
        _region_count(op, 1, self.name)
        carried = [v.type for v in op.operands[2:]]
        region = op.regions[0]
        if [a.type for a in region.args] != [INDEX] + carried:
            raise TypeCheckError(f"{self.name}: the region takes the index and the carried values")
        if _yield_types(region) != carried:
            raise TypeCheckError(f"{self.name}: the region must yield the carried values' types")

    def evaluate(self, op, args, ctx):
        lo, hi, *carried = args
        has_switch = any(o.name == "ac.switch" for o in op.regions[0].ops)
        for it in range(int(lo), int(hi)):
            if ctx.recorder is not None:
                extent = dim(op.attrs.get("extent", 0)).evaluate(ctx.env)
                ctx.recorder.enter_key_block(it, extent, op.attrs.get("tile_class", 1))
                if ctx.recorder.classify_only and not has_switch:
                    continue
            carried = ctx.run_block(op.regions[0], [np.asarray(it, dtype=np.int64), *carried])
        return carried


@register
class TileLoad(OpDef):
    """Rows ``r0 .. r0+rows-1`` of ``src[idx...]`` (zero rows past the end).

    Operands: ``src`` of rank r, r - 2 batch indices, the first row.
    """

    name = "ac.tile_load"
    attributes = {"rows": "rows in the tile"}

    def infer(self, operands, attrs, declared, checker):
        if not operands or len(operands) != operands[0].rank:
            raise TypeCheckError(f"{self.name}: needs src and one index per axis but the last")
        src = operands[0]
        _index_operands(operands[1:], self.name)
        rows = require_attr(attrs, "rows", int, self.name)
        return [TensorType((dim(rows), src.shape[-1]), src.dtype)]

    def evaluate(self, op, args, ctx):
        src, *batch, row0 = args
        rows = op.attrs["rows"]
        block = src[tuple(int(b) for b in batch)][int(row0) : int(row0) + rows]
        tile = np.zeros((rows, src.shape[-1]), dtype=src.dtype)
        tile[: block.shape[0]] = block
        return [tile]


@register
class Map(OpDef):
    """Apply the region's scalar function elementwise over broadcast operands.

    ``role`` ("score" or "mask") tells later passes what the function is.
    """

    name = "ac.map"
    declared_result = True
    attributes = {"role": "what the function computes: score or mask"}

    def infer(self, operands, attrs, declared, checker):
        if not declared or len(declared) != 1:
            raise TypeCheckError(f"{self.name}: needs one declared result type")
        shape = checker.broadcast([t.shape for t in operands], self.name) if operands else ()
        if tuple(shape) != declared[0].shape and operands:
            full = checker.broadcast([shape, declared[0].shape], self.name)
            if full != declared[0].shape:
                raise TypeCheckError(f"{self.name}: operands do not broadcast to {declared[0]}")
        return declared

    def verify_regions(self, op) -> None:
        _region_count(op, 1, self.name)
        region = op.regions[0]
        want = [TensorType((), v.type.dtype) for v in op.operands]
        if [a.type for a in region.args] != want:
            raise TypeCheckError(f"{self.name}: the region takes one 0-d value per operand")
        result = TensorType((), op.results[0].type.dtype)
        if _yield_types(region) != [result]:
            raise TypeCheckError(f"{self.name}: the region must yield one {result}")

    def evaluate(self, op, args, ctx):
        out = ctx.run_block(op.regions[0], args)[0]
        shape = op.results[0].type.concrete_shape(ctx.env)
        return [np.broadcast_to(np.asarray(out), shape).copy()]


@register
class Switch(OpDef):
    """Run region number ``case`` (0-based) and return what it yields.

    With ``tile_class = true`` the case is the tile class of the current key
    block (0 skipped, 1 masked, 2 full), which ``block_map`` reports.
    """

    name = "ac.switch"
    declared_result = True
    attributes = {"tile_class": "bool: the case is a tile classification"}

    def infer(self, operands, attrs, declared, checker):
        if len(operands) != 1:
            raise TypeCheckError(f"{self.name}: takes one case operand")
        _index_operands(operands, self.name)
        return declared or []

    def verify_regions(self, op) -> None:
        if not op.regions:
            raise TypeCheckError(f"{self.name}: needs at least one region")
        want = [r.type for r in op.results]
        for k, region in enumerate(op.regions):
            if region.args:
                raise TypeCheckError(f"{self.name}: region {k} takes no arguments")
            if _yield_types(region) != want:
                raise TypeCheckError(f"{self.name}: region {k} must yield {', '.join(map(str, want))}")

    def evaluate(self, op, args, ctx):
        case = int(args[0])
        if not 0 <= case < len(op.regions):
            raise IndexError(f"{self.name}: case {case} out of range")
        if ctx.recorder is not None and op.attrs.get("tile_class"):
            ctx.recorder.record(case)
            if ctx.recorder.classify_only:
                case = 0  # the skipped case yields the carried values unchanged
        return ctx.run_block(op.regions[case], [])


@register
class BlockReduce(OpDef):
    """Min or max of each block of ``block`` elements along ``axis`` (a short last block too).

    Summaries of captured tensors that mask-elimination bounds tiles with.
    """

    name = "ac.block_reduce"
    declared_result = True
    attributes = {"axis": "the blocked axis", "block": "elements per block", "kind": "min or max"}

    def infer(self, operands, attrs, declared, checker):
        if len(operands) != 1:
            raise TypeCheckError(f"{self.name}: takes one operand")
        src = operands[0]
        axis = require_attr(attrs, "axis", int, self.name) % max(src.rank, 1)
        block = require_attr(attrs, "block", int, self.name)
        if require_attr(attrs, "kind", str, self.name) not in ("min", "max") or block <= 0:
            raise TypeCheckError(f"{self.name}: kind must be min or max and block positive")
        shape = list(src.shape)
        shape[axis] = (shape[axis] + (block - 1)) // block
        return [src.with_shape(shape)]

    def evaluate(self, op, args, ctx):
        x = args[0]
        axis, block = op.attrs["axis"] % x.ndim, op.attrs["block"]
        reduce = np.minimum if op.attrs["kind"] == "min" else np.maximum
        starts = np.arange(0, x.shape[axis], block)
        if starts.size == 0:
            return [np.zeros(x.shape[:axis] + (0,) + x.shape[axis + 1 :], dtype=x.dtype)]
        return [reduce.reduceat(x, starts, axis=axis)]
