"""The ``interp`` backend: the final IR run by the float64 reference interpreter."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from attncomp.backends.base import Program
from attncomp.ir.core import Func, Module
from attncomp.ir.interpreter import Interpreter, interpret_unrounded
from attncomp.ir.printer import print_module


class InterpProgram(Program):
    """Runs the final IR op by op; results are rounded to the declared types, or with
    :meth:`run_exact` kept in float64 (the reference gradients)."""

    backend = "interp"
    reference = True
    #: nothing to compile
    compiled = True

    def __init__(self, module: Module):
        self.func = module.main
        self.source = print_module(module)

    def run_bound(self, arrays: Sequence[Any], env: dict[str, int]) -> list[Any]:
        return Interpreter(self.func, env).run(list(arrays))

    def run_exact(
        self, func: Func, args: Sequence[Any], constraints: Sequence[Any] = (), sizes: dict[str, int] | None = None
    ) -> list[Any]:
        """:meth:`run` with float64 arguments taken and float64 results given, unrounded."""
        return interpret_unrounded(func, args, constraints, sizes)


def build(module: Module) -> InterpProgram:
    return InterpProgram(module)
