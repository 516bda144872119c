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
from attncomp.ir.dims import Dim, dim
from attncomp.ir.ops.base import OpDef, register, require_attr
from attncomp.ir.types import TensorType, is_int

INDEX = TensorType((), "i64")
#: ``ac.tile_grid``'s ``precision``: how its float32 tile products may be computed (absent: "exact")
PRECISIONS = ("exact", "tf32", "ieee")
#: the classes of a key tile, ``ac.switch {tile_class}``'s regions in order (mask-elimination's):
#: no key visible, some (the mask applies), all
SKIPPED, MASKED, FULL = 0, 1, 2


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
        "precision": 'float32 tile products: "exact" (the default, float32-accurate), "tf32" (inputs '
        'rounded to tf32, where the backend has tensor cores) or "ieee" (float32 FMAs)',
        "key_split": "batch-invariant: each row's keys split into parts at multiples of this many positions, "
        "merged in part order (absent: the backend splits by the launch's size)",
        "with_max": "optional bool: the last result is each row's max score",
        "normalized": "optional bool: false: the output is acc exp(m), not acc / l (ac.attention's, sigmoid attention)",
        "score_bound": "optional float: no score exceeds it (ac.attention's): a kernel may take it for every row's max",
    }

    def infer(self, operands, attrs, declared, checker):
        block_q = require_attr(attrs, "block_q", int, self.name)
        if block_q <= 0:
            raise TypeCheckError(f"{self.name}: block_q must be positive")
        split = attrs.get("key_split", 1)
        if not isinstance(split, int) or isinstance(split, bool) or split <= 0:
            raise TypeCheckError(f"{self.name}: key_split must be a positive integer")
        if attrs.get("precision", "exact") not in PRECISIONS:
            raise TypeCheckError(f"{self.name}: precision must be one of {', '.join(PRECISIONS)}")
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

    The region yields one 0-d value per declared result; each result is that
    value over the broadcast shape.  ``role`` ("score", "mask" or
    "gradient") tells later passes what the function is.
    """

    name = "ac.map"
    declared_result = True
    attributes = {"role": "what the function computes: score, mask or gradient"}

    def infer(self, operands, attrs, declared, checker):
        if not declared:
            raise TypeCheckError(f"{self.name}: needs declared result types")
        shape = checker.broadcast([t.shape for t in operands], self.name) if operands else ()
        for result in declared:
            if tuple(shape) != result.shape and operands:
                full = checker.broadcast([shape, result.shape], self.name)
                if full != result.shape:
                    raise TypeCheckError(f"{self.name}: operands do not broadcast to {result}")
        return declared

    def verify_regions(self, op) -> None:
        _region_count(op, 1, self.name)
        region = op.regions[0]
        want = [TensorType((), v.type.dtype) for v in op.operands]
        if [a.type for a in region.args] != want:
            raise TypeCheckError(f"{self.name}: the region takes one 0-d value per operand")
        results = [TensorType((), r.type.dtype) for r in op.results]
        if _yield_types(region) != results:
            shown = ", ".join(map(str, results))
            raise TypeCheckError(f"{self.name}: the region must yield {'one ' if len(results) == 1 else ''}{shown}")

    def evaluate(self, op, args, ctx):
        outs = ctx.run_block(op.regions[0], args)
        shapes = [r.type.concrete_shape(ctx.env) for r in op.results]
        return [np.broadcast_to(np.asarray(out), shape).copy() for out, shape in zip(outs, shapes)]


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
        return [block_reduce(args[0], op.attrs["axis"], op.attrs["block"], op.attrs["kind"])]


def block_reduce(x: np.ndarray, axis: int, block: int, kind: str) -> np.ndarray:
    """The minimum or maximum of each block of ``block`` elements along ``axis`` (the last block may be
    short): what ``ac.block_reduce`` means, and how the interpreter and the cpu backend compute it.

    Along an inner axis, the whole blocks are reduced as an axis of their own (``reduceat`` there
    is 15 to 150 times slower: a boolean ``[1, 4096, 4096]`` mask's maximum over rows in blocks of
    64 takes 83 ms against 0.6 ms); along the last axis ``reduceat`` is the faster.
    """
    axis %= max(x.ndim, 1)
    n = x.shape[axis]
    reduce = np.minimum if kind == "min" else np.maximum
    if n == 0:
        return np.zeros(x.shape[:axis] + (0,) + x.shape[axis + 1 :], dtype=x.dtype)
    if axis == x.ndim - 1:
        return reduce.reduceat(x, np.arange(0, n, block), axis=axis)
    whole = n // block * block
    lead = (slice(None),) * axis
    parts = []
    if whole:
        blocks = x[lead + (slice(0, whole),)].reshape(x.shape[:axis] + (whole // block, block) + x.shape[axis + 1 :])
        parts.append(reduce.reduce(blocks, axis=axis + 1))
    if whole < n:
        parts.append(reduce.reduce(x[lead + (slice(whole, n),)], axis=axis, keepdims=True))
    return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=axis)


@register
class KeyGrid(OpDef):
    """The backward's grid: one program per batch position and block of ``block_k`` keys.

    Results: ``dq [*batch, T, D]``, ``dk``, ``dv`` (``[*kv_batch, S, ...]``), then
    one per gradient site.  The programs run over the batch axes of ``dq`` and
    the ``ceil(S / block_k)`` key blocks of ``dk``; the region gets one index
    per batch axis and the first key ``j0`` and yields

    - the program's part of ``dq`` at its batch position (``[T, D]``), added there;
    - a ``dk`` and a ``dv`` tile (``block_k`` rows), added at rows ``j0 ..`` of
      the batch position whose head is ``h // kv_repeat`` (axes of size 1 read 0);
      rows past ``S`` are dropped;
    - one value per site, of the site's whole type, added up over all programs.

    With ``deterministic = true`` a backend must add these up in an order that is the same on
    every run (no floating-point atomics whose order varies), so that gradients are bit-identical
    from run to run; the sums themselves are the same.  ``precision`` is ``ac.tile_grid``'s: how
    float32 tile products may be computed ("tf32": on tensor cores with inputs rounded to tf32).
    """

    name = "ac.key_grid"
    num_operands = 0
    declared_result = True
    attributes = {
        "block_k": "keys per block",
        "kv_repeat": "query heads per key/value head (a dimension)",
        "deterministic": "bool: sum the gradients in the same order on every run (absent: false)",
        "precision": 'float32 tile products, as ac.tile_grid\'s (absent: "exact")',
    }

    def infer(self, operands, attrs, declared, checker):
        block_k = require_attr(attrs, "block_k", int, self.name)
        require_attr(attrs, "kv_repeat", (int, Dim), self.name)
        if not isinstance(attrs.get("deterministic", False), bool):
            raise TypeCheckError(f"{self.name}: deterministic must be true or false")
        if attrs.get("precision", "exact") not in PRECISIONS:
            raise TypeCheckError(f"{self.name}: precision must be one of {', '.join(PRECISIONS)}")
        if block_k <= 0:
            raise TypeCheckError(f"{self.name}: block_k must be positive")
        if operands:
            raise TypeCheckError(f"{self.name}: takes no operands")
        if not declared or len(declared) < 3:
            raise TypeCheckError(f"{self.name}: needs declared types for dq, dk, dv and the sites")
        dq, dk, dv = declared[:3]
        if dq.rank < 2 or dk.rank != dq.rank or dv.rank != dq.rank or dk.shape[-2] != dv.shape[-2]:
            raise TypeCheckError(f"{self.name}: dq, dk and dv need one rank >= 2 and one key length")
        return declared

    def verify_regions(self, op) -> None:
        _region_count(op, 1, self.name)
        dq, dk, dv = (r.type for r in op.results[:3])
        batch_rank = dq.rank - 2
        region = op.regions[0]
        if [a.type for a in region.args] != [INDEX] * (batch_rank + 1):
            raise TypeCheckError(f"{self.name}: the region takes {batch_rank + 1} i64 indices")
        block = dim(op.attrs["block_k"])
        want = [
            dq.with_shape(dq.shape[batch_rank:]),
            dk.with_shape((block, dk.shape[-1])),
            dv.with_shape((block, dv.shape[-1])),
        ] + [r.type for r in op.results[3:]]
        got = _yield_types(region)
        if len(got) != len(want) or any(g.shape != w.shape for g, w in zip(got, want)):
            raise TypeCheckError(f"{self.name}: the region must yield {', '.join(map(str, want))}")

    def evaluate(self, op, args, ctx):
        block_k = op.attrs["block_k"]
        n_rep = dim(op.attrs["kv_repeat"]).evaluate(ctx.env)
        shapes = [r.type.concrete_shape(ctx.env) for r in op.results]
        outputs = [np.zeros(s, dtype=np.float64) for s in shapes]
        dq_shape, dk_shape = shapes[0], shapes[1]
        batch_rank = len(dq_shape) - 2
        keys = dk_shape[-2]
        for position in itertools.product(*(range(n) for n in dq_shape[:batch_rank])):
            kv_position = list(position)
            if batch_rank >= 2:
                kv_position[1] = position[1] // n_rep
            kv_position = tuple(0 if dk_shape[a] == 1 else p for a, p in enumerate(kv_position))
            for j0 in range(0, keys, block_k):
                if ctx.recorder is not None:
                    grid_shape = tuple(dq_shape[:batch_rank]) + (-(-keys // block_k),)
                    ctx.recorder.enter_query_block(op, position, j0 // block_k, grid_shape)
                index = [np.asarray(p, dtype=np.int64) for p in position] + [np.asarray(j0, dtype=np.int64)]
                dq_part, dk_tile, dv_tile, *sites = ctx.run_block(op.regions[0], index)
                n = min(block_k, keys - j0)
                outputs[0][position] += dq_part
                outputs[1][kv_position + (slice(j0, j0 + n),)] += np.asarray(dk_tile)[:n]
                outputs[2][kv_position + (slice(j0, j0 + n),)] += np.asarray(dv_tile)[:n]
                for out, value in zip(outputs[3:], sites):
                    out += value
        return outputs


@register
class TileAdd(OpDef):
    """``dst`` with a tile's rows added at rows ``row0 ..`` (rows past the end of ``dst`` dropped).

    Operands: ``dst [N, C]``, the first row, ``tile [rows, C]``.
    """

    name = "ac.tile_add"
    num_operands = 3

    def infer(self, operands, attrs, declared, checker):
        if len(operands) != 3:
            raise TypeCheckError(f"{self.name}: needs dst, the first row and a tile")
        dst, row0, tile = operands
        _index_operands([row0], self.name)
        if dst.rank != 2 or tile.rank != 2:
            raise TypeCheckError(f"{self.name}: dst and the tile must have rank 2")
        checker.unify(dst.shape[1], tile.shape[1], f"{self.name}: columns")
        return [dst]

    def evaluate(self, op, args, ctx):
        dst, row0, tile = args
        out = np.array(dst, dtype=np.float64)
        r0 = int(row0)
        n = max(0, min(tile.shape[0], out.shape[0] - r0))
        out[r0 : r0 + n] += np.asarray(tile)[:n]
        return [out]
