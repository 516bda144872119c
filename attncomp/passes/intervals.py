"""Interval arithmetic over IR values, emitted as scalar IR.

For a value computed over a tile (a mask element, a position), ``numeric``
gives IR values ``(lo, hi)`` bounding it over every element of the tile, and
``boolean`` gives ``(always, possible)``: whether the value holds for every
element, and whether it may hold for some.  Rules, one per op:

    add        [a.lo + b.lo, a.hi + b.hi]   (points stay points: a gather at b + B_start is at a point)
    sub        [a.lo - b.hi, a.hi - b.lo]
    neg        [-hi, -lo]
    abs        [lo, hi] when lo >= 0, [-hi, -lo] when hi <= 0, else [0, max(-lo, hi)]
    mul        by a fixed non-negative constant scales; else min/max of the 4 products
    floordiv   by a fixed positive constant: [lo // c, hi // c]
    mod        by a fixed positive constant: [0, c - 1]
    min / max  monotone in both operands
    where      the hull of both branches
    gather     a point when every index is a point; a block summary when
               one index runs over the query rows or key columns of the tile
    cmp        always: the bounds separate; possible: they overlap
    and/or/not the usual three-valued logic

Anything else is unbounded (``None``): comparisons on it are "possible, not
always", so a tile is then computed with its mask, never wrongly skipped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from attncomp.ir.core import Op, Value
from attncomp.passes.builder import Builder
from attncomp.passes.patterns import constant_value, producer

Bounds = tuple[Value | None, Value | None]


@dataclass
class IntervalEmitter:
    """Emits interval IR with ``builder``; ``leaf`` may bound values it knows better."""

    builder: Builder
    #: value -> bounds known up front (region arguments, loop indices, ...)
    known: dict[Value, Bounds] = field(default_factory=dict)
    #: called for a gather over one or two running indices: (source, their axes, their indices, the
    #: point indices, None at those axes)
    summarize: Callable[[Value, list[int], list[Value], list[Value | None]], Bounds | None] | None = None
    #: ops whose results are not visible where the bounds are emitted: recomputed, not referenced
    local_ops: set[Op] = field(default_factory=set)
    memo: dict[Value, Bounds] = field(default_factory=dict)

    # helpers -------------------------------------------------------------
    def emit(self, name: str, *operands: Value, **attrs) -> Value:
        return self.builder.emit(name, *operands, **attrs)

    def const(self, value, dtype: str) -> Value:
        return self.builder.const(value, dtype)

    def point(self, v: Value) -> Bounds:
        return (v, v)

    # numeric bounds ------------------------------------------------------------
    def numeric(self, v: Value) -> Bounds:
        if v in self.known:
            return self.known[v]
        if v in self.memo:
            return self.memo[v]
        result = self._numeric(v)
        self.memo[v] = result
        return result

    def _numeric(self, v: Value) -> Bounds:
        op = producer(v)
        if op is None:
            return self.point(v) if v.type.rank == 0 else (None, None)
        if v.type.rank == 0 and op not in self.local_ops:
            return self.point(v)
        c = constant_value(v)
        if c is not None and not isinstance(c, bool):
            return self.point(self.const(c, v.type.dtype))
        if op.name == "ac.dim":
            return self.point(self.builder.dim(op.attrs["value"]))
        if op.name == "ac.iota":
            size = v.type.shape[op.attrs["axis"] % v.type.rank]
            return (self.const(0, "i64"), self.builder.dim(size - 1))
        rule = getattr(self, "_" + op.name.split(".")[1], None)
        return rule(op) if rule else (None, None)

    def _both(self, fn, a: Value | None, b: Value | None) -> Value | None:
        return None if a is None or b is None else fn(a, b)

    def _add(self, op: Op) -> Bounds:
        (al, ah), (bl, bh) = self.numeric(op.operands[0]), self.numeric(op.operands[1])
        add = lambda x, y: self.emit("ac.add", x, y)  # noqa: E731
        if al is not None and al is ah and bl is not None and bl is bh:  # a point stays a point
            return self.point(add(al, bl))
        return self._both(add, al, bl), self._both(add, ah, bh)

    def _sub(self, op: Op) -> Bounds:
        (al, ah), (bl, bh) = self.numeric(op.operands[0]), self.numeric(op.operands[1])
        sub = lambda x, y: self.emit("ac.sub", x, y)  # noqa: E731
        if al is not None and al is ah and bl is not None and bl is bh:
            return self.point(sub(al, bl))
        return self._both(sub, al, bh), self._both(sub, ah, bl)

    def _neg(self, op: Op) -> Bounds:
        lo, hi = self.numeric(op.operands[0])
        neg = lambda x: None if x is None else self.emit("ac.neg", x)  # noqa: E731
        return neg(hi), neg(lo)

    def _mul(self, op: Op) -> Bounds:
        a, b = op.operands
        for x, y in ((a, b), (b, a)):
            c = constant_value(y)
            if isinstance(c, (int, float)) and not isinstance(c, bool):
                return self._scale(x, c, y.type.dtype)
        (al, ah), (bl, bh) = self.numeric(a), self.numeric(b)
        if None in (al, ah, bl, bh):
            return (None, None)
        products = [self.emit("ac.mul", x, y) for x in (al, ah) for y in (bl, bh)]
        lo, hi = products[0], products[0]
        for p in products[1:]:
            lo, hi = self.emit("ac.minimum", lo, p), self.emit("ac.maximum", hi, p)
        return lo, hi

    def _scale(self, x: Value, c: float, dtype: str) -> Bounds:
        lo, hi = self.numeric(x)
        factor = self.const(c, dtype)
        lo, hi = ((None if z is None else self.emit("ac.mul", z, factor)) for z in (lo, hi))
        return (lo, hi) if c >= 0 else (hi, lo)

    def _abs(self, op: Op) -> Bounds:
        lo, hi = self.numeric(op.operands[0])
        if lo is None or hi is None:
            return (self.const(0, op.results[0].type.dtype), None)
        zero = self.const(0, lo.type.dtype)
        neg_lo, neg_hi = self.emit("ac.neg", lo), self.emit("ac.neg", hi)
        # [lo, hi] >= 0: itself; <= 0: [-hi, -lo]; across 0: [0, max(-lo, hi)]
        low = self.emit(
            "ac.where",
            self.emit("ac.cmp", lo, zero, pred="ge"),
            lo,
            self.emit("ac.where", self.emit("ac.cmp", hi, zero, pred="le"), neg_hi, zero),
        )
        return low, self.emit("ac.maximum", neg_lo, hi)

    def _floordiv(self, op: Op) -> Bounds:
        c = constant_value(op.operands[1])
        if not isinstance(c, int) or isinstance(c, bool) or c <= 0:
            return (None, None)
        lo, hi = self.numeric(op.operands[0])
        k = self.const(c, "i64")
        div = lambda z: None if z is None else self.emit("ac.floordiv", z, k)  # noqa: E731
        return div(lo), div(hi)

    def _mod(self, op: Op) -> Bounds:
        c = constant_value(op.operands[1])
        if not isinstance(c, int) or isinstance(c, bool) or c <= 0:
            return (None, None)
        return self.const(0, "i64"), self.const(c - 1, "i64")

    def _minimum(self, op: Op) -> Bounds:
        (al, ah), (bl, bh) = self.numeric(op.operands[0]), self.numeric(op.operands[1])
        mn = lambda x, y: self.emit("ac.minimum", x, y)  # noqa: E731
        if al is not None and al is ah and bl is not None and bl is bh:  # a point stays a point
            return self.point(mn(al, bl))
        lo = self._both(mn, al, bl)
        hi = ah if bh is None else bh if ah is None else mn(ah, bh)
        return lo, hi

    def _maximum(self, op: Op) -> Bounds:
        (al, ah), (bl, bh) = self.numeric(op.operands[0]), self.numeric(op.operands[1])
        mx = lambda x, y: self.emit("ac.maximum", x, y)  # noqa: E731
        if al is not None and al is ah and bl is not None and bl is bh:  # a point stays a point
            return self.point(mx(al, bl))
        lo = al if bl is None else bl if al is None else mx(al, bl)
        return lo, self._both(mx, ah, bh)

    def _where(self, op: Op) -> Bounds:
        (al, ah), (bl, bh) = self.numeric(op.operands[1]), self.numeric(op.operands[2])
        return (
            self._both(lambda x, y: self.emit("ac.minimum", x, y), al, bl),
            self._both(lambda x, y: self.emit("ac.maximum", x, y), ah, bh),
        )

    def _cast(self, op: Op) -> Bounds:
        lo, hi = self.numeric(op.operands[0])
        cast = lambda z: None if z is None else self.builder.cast(z, op.results[0].type.dtype)  # noqa: E731
        return cast(lo), cast(hi)

    def _gather(self, op: Op) -> Bounds:
        src, *indices = op.operands
        bounds = [self.numeric(i) for i in indices]
        if all(lo is not None and lo is hi for lo, hi in bounds):
            g = self.emit("ac.gather", src, *[lo for lo, _ in bounds])
            return self.point(g)
        running = [k for k, (lo, hi) in enumerate(bounds) if lo is not hi]
        if self.summarize is None or len(running) > 2:
            return (None, None)
        points = [None if k in running else lo for k, (lo, _) in enumerate(bounds)]
        if any(p is None for k, p in enumerate(points) if k not in running):
            return (None, None)
        return self.summarize(src, running, [indices[k] for k in running], points) or (None, None)

    # boolean bounds ----------------------------------------------------------------
    def boolean(self, v: Value) -> Bounds:
        """(always, possible) as 0-d i1 values."""
        if v in self.memo:
            return self.memo[v]
        result = self._boolean(v)
        self.memo[v] = result
        return result

    def unknown_bool(self) -> Bounds:
        return self.const(False, "i1"), self.const(True, "i1")

    def _boolean(self, v: Value) -> Bounds:
        if v in self.known:
            return self.known[v]
        c = constant_value(v)
        if isinstance(c, bool):
            return self.point(self.const(c, "i1"))
        op = producer(v)
        if op is None or (v.type.rank == 0 and op not in self.local_ops):
            return self.point(v) if v.type.rank == 0 else self.unknown_bool()
        if op.name == "ac.cmp":
            return self._compare(op)
        if op.name in ("ac.and", "ac.or"):
            (a_all, a_any), (b_all, b_any) = self.boolean(op.operands[0]), self.boolean(op.operands[1])
            return self.emit(op.name, a_all, b_all), self.emit(op.name, a_any, b_any)
        if op.name == "ac.not":
            always, possible = self.boolean(op.operands[0])
            return self.emit("ac.not", possible), self.emit("ac.not", always)
        if op.name == "ac.gather":  # a boolean tensor's minimum is "always", its maximum "possible"
            always, possible = self.numeric(v)
            if always is not None and possible is not None:
                return always, possible
        return self.unknown_bool()

    def _compare(self, op: Op) -> Bounds:
        pred = op.attrs["pred"]
        (al, ah), (bl, bh) = self.numeric(op.operands[0]), self.numeric(op.operands[1])
        if pred in ("gt", "ge"):
            (al, ah), (bl, bh) = (bl, bh), (al, ah)
            pred = "lt" if pred == "gt" else "le"
        unknown = self.unknown_bool()

        def cmp(x: Value | None, y: Value | None, p: str, fallback: Value) -> Value:
            return fallback if x is None or y is None else self.emit("ac.cmp", x, y, pred=p)

        if pred in ("lt", "le"):
            return cmp(ah, bl, pred, unknown[0]), cmp(al, bh, pred, unknown[1])
        if pred in ("eq", "ne"):
            overlap = self.emit("ac.and", cmp(al, bh, "le", unknown[1]), cmp(bl, ah, "le", unknown[1]))
            single = self.emit(
                "ac.and",
                self.emit("ac.and", cmp(al, ah, "eq", unknown[0]), cmp(bl, bh, "eq", unknown[0])),
                cmp(al, bl, "eq", unknown[0]),
            )
            if pred == "eq":
                return single, overlap
            return self.emit("ac.not", overlap), self.emit("ac.not", single)
        return unknown
