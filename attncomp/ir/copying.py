"""Copies of modules: printed and parsed back, with what the text does not carry.

The pass manager runs a pipeline on such a copy, and every stage is numbered afresh
(``forget_numbers``) so that its text names values in program order.
"""

from __future__ import annotations

from attncomp.ir.core import Module
from attncomp.ir.parser import parse_ir
from attncomp.ir.printer import print_module


def copy_module(module: Module) -> Module:
    """``module`` printed and parsed back, its source locations kept and its numbered names dropped."""
    copy = parse_ir(print_module(module))
    copy_locations(module, copy)
    forget_numbers(copy)
    return copy


def copy_locations(source: Module, copy: Module) -> None:
    """Give ``copy`` (``source`` printed and parsed back) the source locations text does not carry."""
    for original, parsed in zip(source.funcs, copy.funcs):
        for a, b in zip(original.body.walk(), parsed.body.walk()):
            b.loc = a.loc


def forget_numbers(module: Module) -> None:
    """Drop numbered names so each stage is numbered afresh in program order."""
    for func in module.funcs:
        for value in list(func.args) + [r for op in func.body.walk() for r in op.results]:
            if value.name is not None and value.name.isdigit():
                value.name = None
        for op in func.body.walk():
            for region in op.regions:
                for arg in region.args:
                    if arg.name is not None and arg.name.isdigit():
                        arg.name = None
