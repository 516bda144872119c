"""The IR's few node types: values, ops, blocks, functions and modules.

An op is generic: its meaning comes from the :class:`~attncomp.ir.ops.OpDef`
registered under its name.  Values carry an optional name hint; the printer
makes names unique.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from attncomp.ir.types import TensorType


@dataclass(frozen=True)
class Location:
    """Where in the user's source an op was traced from."""

    file: str
    line: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}"


class Value:
    """An SSA value: an op result or a block argument."""

    __slots__ = ("type", "name", "owner")

    def __init__(self, type: TensorType, name: str | None = None, owner: Any = None):
        self.type = type
        self.name = name
        self.owner = owner

    def __repr__(self) -> str:
        return f"Value(%{self.name or '?'}: {self.type})"


@dataclass(eq=False)
class Block:
    """A straight-line list of ops with arguments; the body of a region."""

    args: list[Value] = field(default_factory=list)
    ops: list[Op] = field(default_factory=list)

    def add_arg(self, type: TensorType, name: str | None = None) -> Value:
        value = Value(type, name, self)
        self.args.append(value)
        return value

    def walk(self) -> Iterator[Op]:
        """Every op in the block and, depth first, in its ops' regions."""
        for op in self.ops:
            yield op
            for region in op.regions:
                yield from region.walk()


@dataclass(eq=False)
class Op:
    name: str
    operands: list[Value]
    results: list[Value]
    attrs: dict[str, Any] = field(default_factory=dict)
    regions: list[Block] = field(default_factory=list)
    loc: Location | None = None

    @staticmethod
    def create(
        name: str,
        operands: list[Value],
        result_types: list[TensorType],
        attrs: dict[str, Any] | None = None,
        regions: list[Block] | None = None,
        loc: Location | None = None,
        result_names: list[str | None] | None = None,
    ) -> Op:
        op = Op(name, list(operands), [], dict(attrs or {}), list(regions or []), loc)
        names = result_names or [None] * len(result_types)
        op.results = [Value(t, n, op) for t, n in zip(result_types, names)]
        return op

    @property
    def result(self) -> Value:
        if len(self.results) != 1:
            raise ValueError(f"{self.name} has {len(self.results)} results, not one")
        return self.results[0]


@dataclass(eq=False)
class Func:
    """A function: typed arguments, a body ending in ``ac.return``, attributes."""

    name: str
    body: Block
    attrs: dict[str, Any] = field(default_factory=dict)

    @property
    def args(self) -> list[Value]:
        return self.body.args

    @property
    def return_op(self) -> Op:
        return self.body.ops[-1]

    @property
    def results(self) -> list[Value]:
        return self.return_op.operands

    @property
    def result_types(self) -> list[TensorType]:
        return [v.type for v in self.results]


@dataclass(eq=False)
class Module:
    funcs: list[Func]

    @property
    def main(self) -> Func:
        return self.funcs[0]

    def __str__(self) -> str:
        from attncomp.ir.printer import print_module

        return print_module(self)


def producer(value: Value, name: str | None = None) -> Op | None:
    """The op defining ``value`` (if it is named ``name``, when given)."""
    op = value.owner if isinstance(value.owner, Op) else None
    if op is not None and name is not None and op.name != name:
        return None
    return op


def captured_values(op: Op) -> list[Value]:
    """Values used inside ``op``'s regions but defined outside it, in first-use order."""
    inner: set[Value] = set()
    order: list[Value] = []

    def visit(block: Block) -> None:
        inner.update(block.args)
        for o in block.ops:
            for v in o.operands:
                if v not in inner and v not in order:
                    order.append(v)
            for region in o.regions:
                visit(region)
            inner.update(o.results)

    for region in op.regions:
        visit(region)
    return order
