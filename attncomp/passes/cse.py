"""cse: merge ops that compute the same thing from the same operands.

Two region-free ops are the same when their name, operands, attributes and
result types are equal; later copies are replaced by the first.
"""

from __future__ import annotations

from dataclasses import dataclass

from attncomp.ir.core import Block, Module, Op, Value
from attncomp.ir.printer import format_attrs
from attncomp.passes.base import Pass, register_pass
from attncomp.passes.rewrite import replace_uses


def _key(op: Op) -> tuple | None:
    if op.regions or not op.results or op.name in ("ac.return", "ac.yield"):
        return None
    return (
        op.name,
        tuple(id(v) for v in op.operands),
        format_attrs(op.attrs),
        tuple(str(r.type) for r in op.results),
    )


def cse_block(block: Block) -> None:
    seen: dict[tuple, Op] = {}
    mapping: dict[Value, Value] = {}
    kept = []
    for op in block.ops:
        op.operands = [mapping.get(v, v) for v in op.operands]
        for region in op.regions:
            replace_uses(region, mapping)
            cse_block(region)
        key = _key(op)
        if key is not None and key in seen:
            for old, new in zip(op.results, seen[key].results):
                mapping[old] = new
            continue
        if key is not None:
            seen[key] = op
        kept.append(op)
    block.ops = kept


@register_pass
@dataclass
class CommonSubexpressionElimination(Pass):
    name = "cse"
    summary = "merge identical ops"

    def run(self, module: Module, remarks: list[str]) -> None:
        for func in module.funcs:
            cse_block(func.body)
