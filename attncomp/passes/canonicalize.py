"""canonicalize: fold constants and drop identities, so dumps read cleanly.

Rules are data, one per line: ``(op name, rewrite)``.  A rewrite returns the
value that replaces the op's result, or None.  A replacement must have the
result's exact type, so a rule never changes a shape or a dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from attncomp.ir.core import Block, Module, Op, Value
from attncomp.ir.ops import OP_DEFS, EvalContext
from attncomp.ir.types import TensorType
from attncomp.passes.base import Pass, register_pass
from attncomp.passes.patterns import ELEMENTWISE, constant_value, producer
from attncomp.passes.rewrite import replace_uses


def _is(value: Value, number: float | bool) -> bool:
    """Whether ``value`` is the constant ``number`` (bools and numbers kept apart)."""
    c = constant_value(value)
    if isinstance(number, bool):
        return c is number
    return c is not None and not isinstance(c, bool) and c == number


def _same(op: Op, value: Value) -> Value | None:
    return value if value.type == op.results[0].type else None


def _operand_of(value: Value, name: str, index: int) -> Value | None:
    inner = producer(value, name)
    return None if inner is None else inner.operands[index]


Rule = Callable[[Op], Value | Op | None]


def _flip_sub(op: Op) -> Op | None:
    inner = producer(op.operands[0], "ac.sub")
    if inner is None or inner.results[0].type != op.results[0].type:
        return None
    a, b = inner.operands
    return Op.create("ac.sub", [b, a], [op.results[0].type])


RULES: list[tuple[str, Rule]] = [
    ("ac.add", lambda op: _same(op, op.operands[0]) if _is(op.operands[1], 0) else None),  # x + 0 -> x
    ("ac.add", lambda op: _same(op, op.operands[1]) if _is(op.operands[0], 0) else None),  # 0 + x -> x
    ("ac.sub", lambda op: _same(op, op.operands[0]) if _is(op.operands[1], 0) else None),  # x - 0 -> x
    ("ac.mul", lambda op: _same(op, op.operands[0]) if _is(op.operands[1], 1) else None),  # x * 1 -> x
    ("ac.mul", lambda op: _same(op, op.operands[1]) if _is(op.operands[0], 1) else None),  # 1 * x -> x
    ("ac.div", lambda op: _same(op, op.operands[0]) if _is(op.operands[1], 1) else None),  # x / 1 -> x
    ("ac.neg", lambda op: _same(op, x) if (x := _operand_of(op.operands[0], "ac.neg", 0)) else None),  # --x -> x
    ("ac.neg", _flip_sub),  # -(a - b) -> b - a
    ("ac.not", lambda op: _same(op, x) if (x := _operand_of(op.operands[0], "ac.not", 0)) else None),  # ~~x -> x
    ("ac.and", lambda op: _same(op, op.operands[1]) if _is(op.operands[0], True) else None),  # true & x -> x
    ("ac.and", lambda op: _same(op, op.operands[0]) if _is(op.operands[1], True) else None),  # x & true -> x
    ("ac.or", lambda op: _same(op, op.operands[1]) if _is(op.operands[0], False) else None),  # false | x -> x
    ("ac.or", lambda op: _same(op, op.operands[0]) if _is(op.operands[1], False) else None),  # x | false -> x
    ("ac.where", lambda op: _same(op, op.operands[1]) if _is(op.operands[0], True) else None),  # true ? a : b -> a
    ("ac.where", lambda op: _same(op, op.operands[2]) if _is(op.operands[0], False) else None),  # false ? a : b -> b
    ("ac.minimum", lambda op: _same(op, op.operands[0]) if op.operands[0] is op.operands[1] else None),  # min(x, x)
    ("ac.maximum", lambda op: _same(op, op.operands[0]) if op.operands[0] is op.operands[1] else None),  # max(x, x)
    ("ac.cast", lambda op: _same(op, op.operands[0])),  # a cast to the type it has -> x
]


def _fold(op: Op) -> Op | None:
    """An elementwise op of 0-d constants -> one constant (the interpreter's meaning)."""
    if op.name not in ELEMENTWISE or op.results[0].type.rank != 0:
        return None
    values = [constant_value(v) for v in op.operands]
    if any(v is None for v in values):
        return None
    dtype = op.results[0].type.dtype
    out = OP_DEFS[op.name].evaluate(op, [np.asarray(v) for v in values], EvalContext({}))[0]
    if dtype == "i1":
        value: int | float | bool = bool(out)
    elif dtype.startswith("i"):
        value = int(out)
    else:
        value = float(out)
    return Op.create("ac.constant", [], [TensorType((), dtype)], {"value": value})


def canonicalize_block(block: Block) -> int:
    changes = 0
    mapping: dict[Value, Value] = {}
    kept: list[Op] = []
    for op in block.ops:
        op.operands = [mapping.get(v, v) for v in op.operands]
        for region in op.regions:
            replace_uses(region, mapping)
            changes += canonicalize_block(region)
        replacement = _simplify(op) if op.results and not op.regions else None
        if replacement is None:
            kept.append(op)
        elif isinstance(replacement, Op):
            kept.append(replacement)
            mapping[op.results[0]] = replacement.results[0]
            changes += 1
        else:
            mapping[op.results[0]] = replacement
            changes += 1
    block.ops = kept
    if mapping:
        replace_uses(block, mapping)
    return changes


def _simplify(op: Op) -> Op | Value | None:
    """A folded constant op, a value that replaces the result, or None."""
    folded = _fold(op)
    if folded is not None:
        return folded
    for name, rule in RULES:
        if name == op.name and (replacement := rule(op)) is not None:
            return replacement
    return None


@register_pass
@dataclass
class Canonicalize(Pass):
    name = "canonicalize"
    summary = "fold constants and drop identities (x + 0, x * 1, true & x, ...)"

    def run(self, module: Module, remarks: list[str]) -> None:
        for func in module.funcs:
            while canonicalize_block(func.body):
                pass
