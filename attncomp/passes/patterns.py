"""Matching helpers shared by the rewrites: producers, constants, reductions."""

from __future__ import annotations

import math

from attncomp.ir.core import Op, Value, producer
from attncomp.ir.ops import OP_DEFS
from attncomp.ir.ops.elementwise import Cast, Elementwise, Where

#: ops that compute each element from the same element of their operands
ELEMENTWISE = frozenset(name for name, opdef in OP_DEFS.items() if isinstance(opdef, (Elementwise, Where, Cast)))


def constant_value(value: Value) -> float | int | bool | None:
    op = producer(value, "ac.constant")
    return None if op is None else op.attrs["value"]


def is_neg_inf(value: Value) -> bool:
    c = constant_value(value)
    return isinstance(c, float) and math.isinf(c) and c < 0


def last_axis_reduction(value: Value, kind: str) -> Value | None:
    """If ``value`` is ``reduce_kind(x, axis=-1)`` with the axis kept, return ``x``.

    Accepts ``keepdims=True`` and ``keepdims=False`` followed by a reshape that
    puts back a trailing 1 (the ``m[..., None]`` idiom).
    """
    op = producer(value)
    if op is not None and op.name == "ac.reshape":
        inner = producer(op.operands[0], "ac.reduce")
        if inner is None or inner.attrs["keepdims"]:
            return None
        shape = op.results[0].type.shape
        if shape[:-1] != inner.results[0].type.shape or not (shape[-1].is_const and shape[-1].value == 1):
            return None
        op, keep = inner, False
    elif op is not None and op.name == "ac.reduce":
        keep = op.attrs["keepdims"]
        if not keep:
            return None
    else:
        return None
    src = op.operands[0]
    if op.attrs["kind"] != kind or op.attrs["axes"] != [src.type.rank - 1]:
        return None
    return src


def softmax_division(op: Op) -> Value | None:
    """If ``op`` is ``e / sum(e, axis=-1)`` with ``e = exp(...)`` (a softmax spelled out), return ``e``."""
    if op.name != "ac.div":
        return None
    e, denominator = op.operands
    if last_axis_reduction(denominator, "sum") is not e or producer(e, "ac.exp") is None:
        return None
    return e
