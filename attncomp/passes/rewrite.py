"""Small helpers that rewrites share."""

from __future__ import annotations

from attncomp.ir.core import Block, Value


def replace_uses(block: Block, mapping: dict[Value, Value]) -> None:
    """Replace every use of a key of ``mapping`` in ``block`` (and nested regions)."""
    if not mapping:
        return
    for op in block.ops:
        op.operands = [mapping.get(v, v) for v in op.operands]
        for region in op.regions:
            replace_uses(region, mapping)
