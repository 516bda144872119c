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


def sigmoid_input(value: Value) -> Value | None:
    """If ``value`` is the logistic function of some ``x``, return ``x``: as ``ac.sigmoid`` traces it
    (``where(x >= 0, r, e * r)`` with ``e = exp(where(x >= 0, -x, x))``, ``r = 1 / (1 + e)``) or
    spelled ``1 / (1 + exp(-x))``."""
    op = producer(value)
    if op is None:
        return None
    if op.name == "ac.div":
        e = _one_plus(op.operands[1]) if constant_value(op.operands[0]) == 1.0 else None
        exp = None if e is None else producer(e, "ac.exp")
        neg = None if exp is None else producer(exp.operands[0], "ac.neg")
        return None if neg is None else neg.operands[0]
    if op.name != "ac.where":
        return None
    cond, r, er = op.operands
    test = producer(cond, "ac.cmp")
    if test is None or test.attrs["pred"] != "ge" or constant_value(test.operands[1]) != 0.0:
        return None
    x = test.operands[0]
    div = producer(r, "ac.div")
    mul = producer(er, "ac.mul")
    if div is None or mul is None or constant_value(div.operands[0]) != 1.0 or r not in mul.operands:
        return None
    e = _one_plus(div.operands[1])
    if e is None or e not in mul.operands or producer(e, "ac.exp") is None:
        return None
    branch = producer(producer(e).operands[0], "ac.where")
    if branch is None or branch.operands[0] is not cond or branch.operands[2] is not x:
        return None
    neg = producer(branch.operands[1], "ac.neg")
    return x if neg is not None and neg.operands[0] is x else None


def _one_plus(value: Value) -> Value | None:
    """``y`` of ``1 + y`` (or ``y + 1``), else None."""
    op = producer(value, "ac.add")
    if op is None:
        return None
    a, b = op.operands
    if constant_value(a) == 1.0:
        return b
    return a if constant_value(b) == 1.0 else None
