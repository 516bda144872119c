"""Bounds checks for the gathers of an attention's regions, hoisted out of the tiles.

A gather in a score, mask or gradient region (``table[h, j - i + M]``,
``slopes[h]``, ``doc[b, i]``) runs inside the kernels for every position of
every computed tile, where a bounds check would cost a compare per element and
an out-of-range index would read outside the array.  Before flash-tiling turns
an attention into kernels, :func:`guard_gathers` bounds each index over the
whole grid with the interval arithmetic of :mod:`attncomp.passes.intervals`
(region index arguments run over ``[0, extent)``; a captured tensor read
through a running index is bounded by its minimum and maximum) and puts one
``ac.check_index`` per gather axis at graph level, before the attention.  At
call time those few scalar ops decide (an index in range for every size, such as
``slopes[h]`` with ``H`` slopes, needs no check at all): in bounds, and the kernels read with no
check at all; out of bounds, and the call raises ``IndexError`` before any
kernel runs, so no output is returned, no input is touched, and a decoder's
cache stays as it was.

The bounds are exact (attained at some position) when the index is built from
positions, each used once, by ``+``, ``-``, negation, scaling, floor division
by a constant, ``minimum``/``maximum`` and casts: then the error is the one the
interpreter raises on the unfused graph, the same extreme index.  Otherwise
(an index read from data, a position used twice) they only enclose the index,
and the message says the index *may* reach the bound.  An index that interval
arithmetic cannot bound at all is a compile error naming the spec's line.
Site indices of a backward (where a captured tensor's gradient is added) are
the gathers' own indices and are checked the same way.
"""

from __future__ import annotations

from math import prod

from attncomp.errors import PipelineError, with_location
from attncomp.ir.core import Block, Op, Value
from attncomp.ir.dims import Dim, dim
from attncomp.passes.builder import Builder
from attncomp.passes.intervals import Bounds, IntervalEmitter
from attncomp.passes.patterns import constant_value, producer

#: ops whose bounds, by the rules in intervals.py, are attained when each position occurs once
_EXACT_OPS = {"ac.add", "ac.sub", "ac.neg", "ac.minimum", "ac.maximum", "ac.cast"}


def grid_extents(op: Op) -> list[Dim]:
    """The extents of the region index arguments of an ``ac.attention`` or ``ac.attention_grad``."""
    q, k = op.operands[0], op.operands[1]
    out = op.results[0] if op.name == "ac.attention" else op.operands[3]
    return [*out.type.shape[:-2], q.type.shape[-2], k.type.shape[-2]]


def guard_gathers(block: Block, attn: Op) -> int:
    """Put the ``ac.check_index`` ops of ``attn``'s gathers before it in ``block``; returns how many."""
    extents = grid_extents(attn)
    builder = Builder(block, block.ops.index(attn))
    count: Value | None = None
    checks = 0
    for region in attn.regions:
        index_args = region.args[: len(extents)]
        known: dict[Value, Bounds] = {}
        for arg, extent in zip(index_args, extents):
            known[arg] = (builder.const(0, "i64"), builder.dim(extent - 1))
        for arg in region.args[len(extents) :]:
            known[arg] = (None, None)  # the score and its gradient: not an index
        emitter = _GridBounds(builder, known, local_ops=set(region.ops))
        for site in _indexed_reads(attn, region):
            source_shape, indices, loc = site
            for axis, index in enumerate(indices):
                lo, hi = emitter.numeric(index)
                at = "" if loc is None else str(loc)
                if lo is None or hi is None:
                    raise PipelineError(
                        with_location(
                            f"flash-tiling: cannot bound index {axis} of this ac.gather over the positions "
                            "(it would be read unchecked); clamp it with ac.minimum/ac.maximum",
                            at,
                        )
                    )
                if _proven(lo, hi, source_shape[axis]):
                    continue  # in range for every size: nothing to check at call time
                if count is None:
                    count = builder.dim(prod(extents[1:], start=extents[0]))
                attrs = {
                    "axis": axis,
                    "size": source_shape[axis],
                    "exact": _exact(index, set(index_args), set(region.ops)),
                    "at": at,
                }
                builder.op("ac.check_index", [builder.cast(lo, "i64"), builder.cast(hi, "i64"), count], attrs)
                checks += 1
    return checks


def _static(v: Value) -> Dim | None:
    """``v`` as a size expression, when it is a constant or an ``ac.dim``."""
    c = constant_value(v)
    if isinstance(c, int) and not isinstance(c, bool):
        return dim(c)
    op = producer(v)
    return dim(op.attrs["value"]) if op is not None and op.name == "ac.dim" else None


def _proven(lo: Value, hi: Value, size: Dim) -> bool:
    """``0 <= lo`` and ``hi < size`` for every size: e.g. ``slopes[h]`` with slopes sized ``H``."""
    low, high = _static(lo), _static(hi)
    if low is None or high is None or not low.is_const or low.value < 0:
        return False
    room = dim(size) - high
    return room.is_const and room.value >= 1


def _indexed_reads(attn: Op, region: Block) -> list[tuple[list[Dim], list[Value], object]]:
    """(source shape, index values, location) of each gather in ``region``, and of each site index
    its yield carries (the gradient region of ``ac.attention_grad``)."""
    reads = []
    for op in region.ops:
        if op.name == "ac.gather":
            src, *indices = op.operands
            reads.append((list(src.type.shape), indices, op.loc))
    if attn.name == "ac.attention_grad" and region is attn.regions[2]:
        yielded = region.ops[-1].operands
        at = 1
        for site in attn.results[3:]:
            rank = site.type.rank
            reads.append((list(site.type.shape), yielded[at + 1 : at + 1 + rank], None))
            at += 1 + rank
    return reads


class _GridBounds(IntervalEmitter):
    """Interval arithmetic over the whole grid: a captured tensor read at running indices lies
    between its minimum and maximum."""

    def _gather(self, op: Op) -> Bounds:
        src, *indices = op.operands
        bounds = [self.numeric(i) for i in indices]
        if all(lo is not None and lo is hi for lo, hi in bounds) or src.type.dtype == "i1":
            return super()._gather(op)
        axes = list(range(src.type.rank))
        lo = self.emit("ac.reduce", src, kind="min", axes=axes, keepdims=False)
        hi = self.emit("ac.reduce", src, kind="max", axes=axes, keepdims=False)
        return lo, hi


def _exact(index: Value, positions: set[Value], local: set[Op]) -> bool:
    """Whether interval bounds of ``index`` are attained: monotone ops over positions used once each.

    ``local`` holds the region's ops; a value from outside it is one number.
    """
    seen: list[Value] = []

    def walk(v: Value) -> bool:
        if v in positions:
            seen.append(v)
            return True
        op = producer(v)
        if op is None or op not in local or constant_value(v) is not None or op.name == "ac.dim":
            return True
        if op.name in ("ac.mul", "ac.floordiv"):
            a, b = op.operands
            c, other = constant_value(b), a
            if op.name == "ac.mul" and c is None:
                c, other = constant_value(a), b
            scales = isinstance(c, int) and not isinstance(c, bool) and (c > 0 or (op.name == "ac.mul" and c < 0))
            return scales and walk(other)
        return op.name in _EXACT_OPS and all(walk(x) for x in op.operands)

    return walk(index) and len(seen) == len(set(seen))
