"""Changing the element type of a module's values, in place (the ``widen-bf16`` pass)."""

from __future__ import annotations

from collections.abc import Iterator

from attncomp.ir.core import Block, Module, Value


def values(module: Module) -> Iterator[Value]:
    """Every value of ``module``: arguments, op results and region arguments."""

    def of_block(block: Block) -> Iterator[Value]:
        yield from block.args
        for op in block.ops:
            yield from op.results
            for region in op.regions:
                yield from of_block(region)

    for func in module.funcs:
        yield from of_block(func.body)


def holds_dtype(module: Module, dtype: str) -> bool:
    """Whether any value of ``module`` has elements of type ``dtype``."""
    return any(v.type.dtype == dtype for v in values(module))


def retype(module: Module, old: str, new: str) -> int:
    """Give every value of element type ``old`` the type ``new`` (same shape); how many changed.

    Only values' types change: attributes and the ops themselves stay as they are (an ``ac.cast``
    to ``old`` becomes a cast to ``new``, its result's type)."""
    changed = 0
    for value in values(module):
        if value.type.dtype == old:
            value.type = value.type.with_dtype(new)
            changed += 1
    return changed
