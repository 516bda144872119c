"""mask-elimination: skip, or drop the mask of, key tiles from the mask itself.

For every key-block loop made by flash-tiling, interval arithmetic over the
positions a tile covers (see :mod:`attncomp.passes.intervals`) classifies
each tile at run time, before its work:

    0  skipped   no key of the tile is visible to any query of the block
    1  masked    some are: the mask is evaluated per element
    2  full      all are: the mask is not evaluated

The loop body becomes an ``ac.switch {tile_class = true}`` over those three
cases.  Masks that read captured tensors (document ids, lengths) are bounded
through a per-block min/max summary of the tensor (``ac.block_reduce``, built
once per call in O(T)); a tensor read at both positions (a mask given as
data, ``m[b, i, j]``) through one over blocks of both axes (the query axis's
summary reduced again along the keys, O(T S) once per call): a boolean's
minimum over a tile says every pair is visible, its maximum that some is.  A table of
blocks read at ``i // rows`` (FlexAttention's block lists) is read at the entries a tile's
positions reach (two at most where blocks are as large as tiles), or summarised over the
whole entries a tile holds.
For conditions affine in the key position ``j`` (causal, windows, prefix,
lengths) the loop bounds are also tightened, so skipped tiles past them cost
nothing.  No dense mask is ever built.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import reduce
from itertools import product

from attncomp.ir.core import Block, Func, Module, Op, Value
from attncomp.ir.graph import remove_dead_ops
from attncomp.ir.ops.tile import FULL, MASKED, SKIPPED
from attncomp.ir.types import BOOL_DTYPE
from attncomp.passes.base import Pass, register_pass
from attncomp.passes.builder import Builder, clone_block
from attncomp.passes.intervals import Bounds, IntervalEmitter
from attncomp.passes.patterns import constant_value, producer
from attncomp.passes.rewrite import replace_uses


@dataclass
class Summaries:
    """Per-block min/max summaries of captured tensors, built before the grid."""

    func: Func
    grid: Op
    made: dict[tuple, tuple[Value, Value]] = field(default_factory=dict)

    def get(self, src: Value, axes: list[int], blocks: list[int]) -> tuple[Value, Value]:
        """``src``'s minimum and maximum over blocks of ``blocks[n]`` elements along ``axes[n]``: a
        summary along two axes (a mask gathered at both positions) reduces the one along the first."""
        key = (src, tuple(axes), tuple(blocks))
        if key not in self.made:
            base = (src, src) if len(axes) == 1 else self.get(src, axes[:-1], blocks[:-1])
            axis, block = axes[-1], blocks[-1]
            if block == 1:  # entries one by one: the tensor itself
                return base
            builder = Builder(self.func.body, self.func.body.ops.index(self.grid))
            made = []
            for kind, part in zip(("min", "max"), base):
                shape = list(part.type.shape)
                shape[axis] = (shape[axis] + (block - 1)) // block
                attrs = {"axis": axis, "block": block, "kind": kind}
                made.append(builder.op("ac.block_reduce", [part], attrs, [part.type.with_shape(shape)]).result)
            self.made[key] = (made[0], made[1])
        return self.made[key]


@dataclass
class TileContext:
    """What the analysis of one loop of tiles needs to know about its tiling.

    In the forward (``ac.tile_grid``) a program holds a block of queries and
    loops over key blocks; in the backward (``ac.key_grid``, ``transposed``) a
    program holds a block of keys and loops over query blocks.
    """

    func: Func
    grid: Op
    loop: Op
    mask: Op
    summaries: Summaries

    @property
    def transposed(self) -> bool:
        return self.grid.name == "ac.key_grid"

    @property
    def block_q(self) -> int:
        return (self.loop if self.transposed else self.grid).attrs["block_q"]

    @property
    def block_k(self) -> int:
        return (self.grid if self.transposed else self.loop).attrs["block_k"]

    @property
    def row_arg(self) -> Value:
        return self.mask.regions[0].args[-2]

    @property
    def col_arg(self) -> Value:
        return self.mask.regions[0].args[-1]

    @property
    def loop_arg(self) -> Value:
        """The mask argument whose position the loop moves (keys; queries when transposed)."""
        return self.row_arg if self.transposed else self.col_arg

    def emitter(self, builder: Builder, local: set[Op], unknown: Value | None) -> IntervalEmitter:
        """Interval code for the mask's values, with every mask argument bounded but ``unknown``."""
        region = self.mask.regions[0]
        grid_start = self.grid.regions[0].args[-1]
        counter = self.loop.regions[0].args[0]

        def offset_of(index: Value) -> tuple[Value | None, Value | None]:
            """``(position, offset)`` when ``index`` is a row or key position plus a size (a chunk's start)."""
            op = producer(index)
            if op is not None and op.name == "ac.add" and op in region.ops:
                for base, off in (op.operands, op.operands[::-1]):
                    sized = producer(off)
                    if base in (self.row_arg, self.col_arg) and sized is not None and sized.name == "ac.dim":
                        return base, builder.dim(sized.attrs["value"])
            return None, None

        def divided_of(index: Value) -> tuple[Value | None, Value | None, int]:
            """``(position, offset, n)`` when ``index`` is a row or key position (plus a size, a chunk's
            start) floor-divided by a constant ``n``: the number of a block of ``n`` positions, as a
            table of blocks is read."""
            op = producer(index)
            if op is not None and op.name == "ac.floordiv" and op in region.ops:
                divisor, inner = constant_value(op.operands[1]), op.operands[0]
                if isinstance(divisor, int) and divisor > 0:
                    if inner in (self.row_arg, self.col_arg):
                        return inner, None, divisor
                    position, offset = offset_of(inner)
                    if position is not None:
                        return position, offset, divisor
            return None, None, 1

        def block_numbers(index: Value, offset: Value | None, block: int, per_block: int, size: Value) -> list[Value]:
            """The summary blocks, of ``per_block`` positions each, that a tile's positions (plus
            ``offset``) fall in: one where tiles lie within them, else the first and the last
            position's, kept within the ``size`` blocks of the summary."""
            emit, const = builder.emit, builder.const
            loop_axis = (index is self.row_arg) == self.transposed
            if offset is None and per_block == block:  # the tile's own number
                return [counter] if loop_axis else [emit("ac.floordiv", grid_start, const(block, "i64"))]
            start = emit("ac.mul", counter, const(block, "i64")) if loop_axis else grid_start
            if offset is None and per_block % block == 0:
                return [emit("ac.floordiv", start, const(per_block, "i64"))]
            first = start if offset is None else emit("ac.add", start, offset)
            last = emit("ac.add", first, const(block - 1, "i64"))
            found = [emit("ac.floordiv", row, const(per_block, "i64")) for row in (first, last)]
            end = emit("ac.sub", size, const(1, "i64"))  # the second may lie past the summary's end
            return [emit("ac.minimum", n, end) for n in found]

        def summarize(src: Value, axes: list[int], indices: list[Value], points: list[Value | None]) -> Bounds | None:
            """Bounds of ``src`` over a tile, from its per-block summary along ``axes`` (one or two)."""
            if not _visible_before(self.func, self.grid, src):
                return None
            resolved = []
            for index in indices:
                offset, divisor = None, 1
                if index not in (self.row_arg, self.col_arg):
                    position, offset, divisor = divided_of(index)
                    index, offset = (position, offset) if position is not None else offset_of(index)
                if index is None or index is unknown:
                    return None
                block = self.block_q if index is self.row_arg else self.block_k
                if block > divisor > 1 and block % divisor:
                    return None  # blocks of positions that tiles cut unevenly
                # the summary's blocks: a tile's positions, or the entries of a table of blocks it holds
                summary = block if divisor == 1 else max(block // divisor, 1)
                resolved.append((index, offset, block, divisor, summary))
            if len({index for index, *_ in resolved}) != len(resolved):
                return None  # one position on two axes (a diagonal): no block summary bounds it
            lo, hi = self.summaries.get(src, axes, [summary for *_, summary in resolved])
            numbers = []
            for axis, (index, offset, block, divisor, summary) in zip(axes, resolved):
                size = builder.dim(lo.type.shape[axis])
                numbers.append(block_numbers(index, offset, block, divisor * summary, size))
            lows, highs = [], []
            for at_blocks in product(*numbers):
                at = list(points)
                for axis, number in zip(axes, at_blocks):
                    at[axis] = number
                lows.append(builder.emit("ac.gather", lo, *at))
                highs.append(builder.emit("ac.gather", hi, *at))
            fold = lambda name, values: reduce(lambda x, y: builder.emit(name, x, y), values)  # noqa: E731
            if src.type.dtype == BOOL_DTYPE:  # a boolean's minimum is "and", its maximum "or"
                return fold("ac.and", lows), fold("ac.or", highs)
            return fold("ac.minimum", lows), fold("ac.maximum", highs)

        emitter = IntervalEmitter(builder, summarize=summarize, local_ops=local | set(region.ops))
        for arg, operand in zip(region.args, self.mask.operands):
            if arg is not unknown:
                emitter.known[arg] = emitter.numeric(operand)
        return emitter


def _visible_before(func: Func, grid: Op, value: Value) -> bool:
    """Whether ``value`` is a function argument or defined before ``grid`` at top level."""
    if value in func.args:
        return True
    op = producer(value)
    return op is not None and op in func.body.ops and func.body.ops.index(op) < func.body.ops.index(grid)


# the per-tile switch ---------------------------------------------------------------
def classify_tiles(ctx: TileContext) -> None:
    body = ctx.loop.regions[0]
    old_ops = body.ops
    body.ops = []
    new = Builder(body)
    emitter = ctx.emitter(new, set(old_ops), unknown=None)
    visible = ctx.mask.regions[0].ops[-1].operands[0]
    always, possible = emitter.boolean(visible)
    partial = new.emit("ac.where", always, new.const(FULL, "i64"), new.const(MASKED, "i64"))
    tile_class = new.emit("ac.where", possible, partial, new.const(SKIPPED, "i64"))
    tile_class.name = "tile_class"

    skipped = Block()
    Builder(skipped).yield_(*body.args[1:])
    masked = Block(ops=old_ops)
    full = clone_block(masked)
    mask_at = old_ops.index(ctx.mask)
    full_mask = full.ops[mask_at]
    true_tile = Op.create("ac.constant", [], [full_mask.results[0].type], {"value": True})
    full.ops[mask_at] = true_tile
    replace_uses(full, {full_mask.results[0]: true_tile.results[0]})
    remove_dead_ops(full)
    carried = [a.type for a in body.args[1:]]
    switch = new.op("ac.switch", [tile_class], {"tile_class": True}, carried, [skipped, masked, full])
    new.yield_(*switch.results)


# loop bounds for conditions affine in j ---------------------------------------------
Affine = tuple[int, list[tuple[int, Value]]]


def _depends_on(region: Block, arg: Value) -> set[Value]:
    found = {arg}
    for op in region.ops:
        if any(v in found for v in op.operands):
            found.update(op.results)
    return found


def _affine(v: Value, j: Value, uses_j: set[Value]) -> Affine | None:
    """``v`` as ``coef * j + sum(sign * term)`` with terms free of ``j``."""
    if v is j:
        return 1, []
    if v not in uses_j:
        return 0, [(1, v)]
    op = producer(v)
    if op is None or op.name not in ("ac.add", "ac.sub", "ac.neg", "ac.cast"):
        return None
    parts = [_affine(x, j, uses_j) for x in op.operands]
    if any(p is None for p in parts):
        return None
    if op.name == "ac.cast":
        return parts[0]
    if op.name == "ac.neg":
        c, terms = parts[0]
        return -c, [(-s, t) for s, t in terms]
    (ca, ta), (cb, tb) = parts
    if op.name == "ac.add":
        return ca + cb, ta + tb
    return ca - cb, ta + [(-s, t) for s, t in tb]


def _combine(builder: Builder, fn: str, a: Value | None, b: Value | None, keep_one: bool) -> Value | None:
    if a is None or b is None:
        return (a if b is None else b) if keep_one else None
    return builder.emit(fn, a, b)


def key_bounds(v: Value, j: Value, uses_j: set[Value], emitter: IntervalEmitter) -> Bounds:
    """(lowest, highest) key position that condition ``v`` can allow in the tile; None: unbounded."""
    b = emitter.builder
    op = producer(v)
    if op is None:
        return None, None
    if op.name == "ac.and":
        (l1, h1), (l2, h2) = (key_bounds(x, j, uses_j, emitter) for x in op.operands)
        return _combine(b, "ac.maximum", l1, l2, True), _combine(b, "ac.minimum", h1, h2, True)
    if op.name == "ac.or":
        (l1, h1), (l2, h2) = (key_bounds(x, j, uses_j, emitter) for x in op.operands)
        return _combine(b, "ac.minimum", l1, l2, False), _combine(b, "ac.maximum", h1, h2, False)
    if op.name != "ac.cmp":
        return None, None
    lhs, rhs = (_affine(x, j, uses_j) for x in op.operands)
    if lhs is None or rhs is None:
        return None, None
    coef = lhs[0] - rhs[0]
    terms = lhs[1] + [(-s, t) for s, t in rhs[1]]
    if coef not in (1, -1) or any(t.type.dtype not in ("i32", "i64") for _, t in terms):
        return None, None
    # coef*j + r (pred) 0, with r in [r_lo, r_hi]
    r_lo = r_hi = None
    for sign, term in terms:
        lo, hi = emitter.numeric(term)
        if lo is None or hi is None:
            return None, None
        lo, hi = b.cast(lo, "i64"), b.cast(hi, "i64")
        if sign < 0:
            lo, hi = b.emit("ac.neg", hi), b.emit("ac.neg", lo)
        r_lo = lo if r_lo is None else b.emit("ac.add", r_lo, lo)
        r_hi = hi if r_hi is None else b.emit("ac.add", r_hi, hi)
    if r_lo is None:
        r_lo = r_hi = b.const(0, "i64")
    pred = op.attrs["pred"]
    if coef == -1:  # -j + r (pred) 0  <=>  j (flipped pred) r
        flipped = {"le": "ge", "lt": "gt", "ge": "le", "gt": "lt", "eq": "eq", "ne": "ne"}[pred]
        pred, low_ref, high_ref = flipped, r_lo, r_hi
    else:  # j (pred) -r
        low_ref, high_ref = b.emit("ac.neg", r_hi), b.emit("ac.neg", r_lo)
    one = b.const(1, "i64")
    return {
        "le": (None, high_ref),
        "lt": (None, b.emit("ac.sub", high_ref, one)),
        "ge": (low_ref, None),
        "gt": (b.emit("ac.add", low_ref, one), None),
        "eq": (low_ref, high_ref),
    }.get(pred, (None, None))


def tighten_loop_bounds(ctx: TileContext) -> None:
    """Start and end the loop at the blocks of the positions the mask can allow."""
    grid_body = ctx.grid.regions[0]
    builder = Builder(grid_body, grid_body.ops.index(ctx.loop))
    moving = ctx.loop_arg
    emitter = ctx.emitter(builder, set(), unknown=moving)
    region = ctx.mask.regions[0]
    lo, hi = key_bounds(region.ops[-1].operands[0], moving, _depends_on(region, moving), emitter)
    block = builder.const(ctx.block_q if ctx.transposed else ctx.block_k, "i64")
    prefix = "qb" if ctx.transposed else "kb"
    if lo is not None:
        first = builder.emit("ac.floordiv", lo, block)
        lo_value = builder.emit("ac.maximum", ctx.loop.operands[0], first)
        lo_value.name = f"{prefix}_first"
        ctx.loop.operands[0] = lo_value
    if hi is not None:
        last = builder.emit("ac.add", builder.emit("ac.floordiv", hi, block), builder.const(1, "i64"))
        hi_value = builder.emit("ac.minimum", ctx.loop.operands[1], last)
        hi_value.name = f"{prefix}_end"
        ctx.loop.operands[1] = hi_value


def eliminate(func: Func, grid: Op, loop: Op, summaries: Summaries) -> None:
    body = loop.regions[0]
    masks = [op for op in body.ops if op.name == "ac.map" and op.attrs.get("role") == "mask"]
    if len(masks) != 1:
        return
    mask = masks[0]
    if constant_value(mask.regions[0].ops[-1].operands[0]) is True:
        true_tile = Op.create("ac.constant", [], [mask.results[0].type], {"value": True})
        body.ops[body.ops.index(mask)] = true_tile
        replace_uses(body, {mask.results[0]: true_tile.results[0]})
        loop.attrs["tile_class"] = FULL
        remove_dead_ops(body)
        return
    ctx = TileContext(func, grid, loop, mask, summaries)
    tighten_loop_bounds(ctx)
    classify_tiles(ctx)


@register_pass
@dataclass
class MaskElimination(Pass):
    name = "mask-elimination"
    summary = "classify key tiles as skipped, masked or full; tighten loop bounds"

    def run(self, module: Module, remarks: list[str]) -> None:
        for func in module.funcs:
            grids = [op for op in func.body.ops if op.name in ("ac.tile_grid", "ac.key_grid")]
            if not grids and any(op.name == "ac.attention" for op in func.body.ops):
                remarks.append("mask-elimination: nothing to do: run flash-tiling first")
            for grid in grids:
                summaries = Summaries(func, grid)
                for loop in [op for op in grid.regions[0].ops if op.name == "ac.tile_for"]:
                    eliminate(func, grid, loop, summaries)
