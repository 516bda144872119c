"""The IR's text form: one op per line, SSA names, sorted attributes.

    %r0, %r1 = ac.op %a, %b {key = value, ...} : type0, type1 ({
    ^bb0(%x: type, ...):
      ...
      ac.yield %y
    })

Names come from the values' hints (the spec's variable names) made unique
with ``_1``, ``_2`` suffixes; values without a hint are numbered.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from attncomp.ir.core import Block, Func, Module, Op, Value
from attncomp.ir.dims import Dim

INDENT = "  "


@dataclass
class Namer:
    """Gives every value of a function a unique printed name, in program order."""

    names: dict[Value, str] = field(default_factory=dict)
    used: set[str] = field(default_factory=set)
    counter: int = 0

    @staticmethod
    def for_func(func: Func) -> Namer:
        namer = Namer()
        # Hinted names first, so a numbered value never takes a user's name.
        values = list(_values_in_order(func.body))
        for value in values:
            if value.name is not None:
                namer._claim(value, value.name)
        for value in values:
            if value.name is None:
                while str(namer.counter) in namer.used:
                    namer.counter += 1
                namer._claim(value, str(namer.counter))
        return namer

    def _claim(self, value: Value, hint: str) -> None:
        name, k = hint, 0
        while name in self.used:
            k += 1
            name = f"{hint}_{k}"
        self.used.add(name)
        self.names[value] = name

    def __getitem__(self, value: Value) -> str:
        if value not in self.names:  # defined outside the function: only malformed IR, as a verifier shows it
            return "?" + (value.name or "")
        return self.names[value]


def _values_in_order(block: Block):
    yield from block.args
    for op in block.ops:
        yield from op.results
        for region in op.regions:
            yield from _values_in_order(region)


def format_attr(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, Dim):
        return str(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(format_attr(v) for v in value) + "]"
    raise TypeError(f"cannot print attribute value {value!r}")


def format_attrs(attrs: dict[str, Any]) -> str:
    if not attrs:
        return ""
    return "{" + ", ".join(f"{k} = {format_attr(attrs[k])}" for k in sorted(attrs)) + "}"


class Printer:
    def __init__(self, namer: Namer):
        self.namer = namer
        self.lines: list[str] = []
        self.op_line: dict[Op, int] = {}

    def ref(self, value: Value) -> str:
        return "%" + self.namer[value]

    def block_args(self, block: Block) -> str:
        return ", ".join(f"{self.ref(a)}: {a.type}" for a in block.args)

    def op(self, op: Op, depth: int) -> None:
        text = INDENT * depth
        if op.results:
            text += ", ".join(self.ref(r) for r in op.results) + " = "
        text += op.name
        if op.operands:
            text += " " + ", ".join(self.ref(v) for v in op.operands)
        if op.attrs:
            text += " " + format_attrs(op.attrs)
        if op.results:
            text += " : " + ", ".join(str(r.type) for r in op.results)
        self.op_line[op] = len(self.lines)
        if not op.regions:
            self.lines.append(text)
            return
        self.lines.append(text + " ({")
        for k, region in enumerate(op.regions):
            if k:
                self.lines.append(INDENT * depth + "}, {")
            self.lines.append(INDENT * depth + f"^bb0({self.block_args(region)}):")
            for inner in region.ops:
                self.op(inner, depth + 1)
        self.lines.append(INDENT * depth + "})")

    def func(self, func: Func) -> None:
        # a function that lacks its ac.return (shown in a verifier error) has no results
        returns = bool(func.body.ops) and func.return_op.name == "ac.return"
        results = [str(t) for t in func.result_types] if returns else []
        ret = results[0] if len(results) == 1 else "(" + ", ".join(results) + ")"
        head = f"ac.func @{func.name}({self.block_args(func.body)}) -> {ret}"
        if func.attrs:
            head += " attributes " + format_attrs(func.attrs)
        self.lines.append(head + " {")
        for op in func.body.ops:
            self.op(op, 1)
        self.lines.append("}")


def print_func_lines(func: Func) -> tuple[list[str], dict[Op, int]]:
    """The printed lines of a function and the line index of each op."""
    printer = Printer(Namer.for_func(func))
    printer.func(func)
    return printer.lines, printer.op_line


def print_module(module: Module) -> str:
    chunks = ["\n".join(print_func_lines(f)[0]) for f in module.funcs]
    return "\n\n".join(chunks) + "\n"
