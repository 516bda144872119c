"""Emitting ops with inferred types, and cloning regions: what rewrites build with."""

from __future__ import annotations

from typing import Any

from attncomp.ir.core import Block, Location, Op, Value
from attncomp.ir.dims import Dim
from attncomp.ir.ops import OP_DEFS, Checker
from attncomp.ir.types import TensorType


class Builder:
    """Appends ops to ``block`` (or inserts them at ``at``)."""

    def __init__(self, block: Block, at: int | None = None):
        self.block = block
        self.at = at

    def op(
        self,
        name: str,
        operands: list[Value],
        attrs: dict[str, Any] | None = None,
        declared: list[TensorType] | None = None,
        regions: list[Block] | None = None,
        names: list[str | None] | None = None,
        loc: Location | None = None,
    ) -> Op:
        attrs = attrs or {}
        types = OP_DEFS[name].infer([v.type for v in operands], attrs, declared, Checker())
        op = Op.create(name, operands, types, attrs, regions, loc, names)
        if self.at is None:
            self.block.ops.append(op)
        else:
            self.block.ops.insert(self.at, op)
            self.at += 1
        return op

    def emit(self, name: str, *operands: Value, **attrs: Any) -> Value:
        return self.op(name, list(operands), attrs).result

    def const(self, value: int | float | bool, dtype: str, shape: tuple = ()) -> Value:
        return self.op("ac.constant", [], {"value": value}, [TensorType.of(shape, dtype)]).result

    def dim(self, value: Dim | int) -> Value:
        """A size as a 0-d i64 (a constant when the size is fixed)."""
        if isinstance(value, int) or value.is_const:
            return self.const(value if isinstance(value, int) else value.value, "i64")
        return self.op("ac.dim", [], {"value": value}, [TensorType((), "i64")]).result

    def cast(self, value: Value, dtype: str) -> Value:
        if value.type.dtype == dtype:
            return value
        return self.op("ac.cast", [value], declared=[value.type.with_dtype(dtype)]).result

    def yield_(self, *values: Value) -> None:
        self.op("ac.yield", list(values))


def inline_region(builder: Builder, region: Block, args: list[Value]) -> list[Value]:
    """Clone ``region``'s ops into ``builder`` with its arguments bound to ``args``.

    Types are inferred again, so a scalar function applied to tiles gives tiles.
    Returns the values the region yields.
    """
    mapping: dict[Value, Value] = dict(zip(region.args, args))
    for op in region.ops:
        operands = [mapping.get(v, v) for v in op.operands]
        if op.name == "ac.yield":
            return operands
        declared = None
        if op.name == "ac.cast":
            declared = [operands[0].type.with_dtype(op.results[0].type.dtype)]
        elif OP_DEFS[op.name].declared_result:
            declared = [r.type for r in op.results]
        regions = [_clone_block(r, mapping) for r in op.regions]
        new = builder.op(op.name, operands, op.attrs, declared, regions, loc=op.loc)
        mapping.update(zip(op.results, new.results))
    raise ValueError("region has no ac.yield")


def _clone_block(block: Block, outer: dict[Value, Value]) -> Block:
    mapping = dict(outer)
    clone = Block()
    for arg in block.args:
        mapping[arg] = clone.add_arg(arg.type, arg.name)
    for op in block.ops:
        new = Op.create(
            op.name,
            [mapping.get(v, v) for v in op.operands],
            [r.type for r in op.results],
            op.attrs,
            [_clone_block(r, mapping) for r in op.regions],
            op.loc,
        )
        mapping.update(zip(op.results, new.results))
        clone.ops.append(new)
    return clone


def clone_block(block: Block) -> Block:
    """A deep copy of ``block`` whose ops still use the same outside values."""
    return _clone_block(block, {})
