"""The reference interpreter: runs any stage of the IR op by op in float64.

Floats are computed as float64, integers as int64, whatever the declared
element types, so the result is the exact meaning of the IR against which
every pass and backend is checked.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from attncomp.errors import with_location
from attncomp.ir.binding import bind_arguments
from attncomp.ir.core import Block, Func, Op, Value
from attncomp.ir.ops import OP_DEFS, EvalContext
from attncomp.ir.ops.base import float64_like
from attncomp.ir.printer import Namer
from attncomp.ir.verifier import verify_func


class Interpreter:
    def __init__(self, func: Func, env: dict[str, int], trace: bool = False):
        self.func = func
        self.ctx = EvalContext(env, run_block=self.run_block)
        self.trace = trace
        self.namer = Namer.for_func(func) if trace else None
        self.values: dict[str, np.ndarray] = {}

    def record(self, value: Value, array: np.ndarray) -> None:
        if self.namer is not None:
            self.values[self.namer[value]] = array

    def run_block(self, block: Block, args: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Run ``block`` with its arguments bound; return its terminator's operands."""
        env: dict[Value, np.ndarray] = dict(self.outer)
        for value, array in zip(block.args, args):
            env[value] = array
            self.record(value, array)
        saved = self.outer
        self.outer = env
        try:
            for op in block.ops:
                inputs = [env[v] for v in op.operands]
                if OP_DEFS[op.name].terminator:
                    return inputs
                self.run_op(op, inputs, env)
        finally:
            self.outer = saved
        return []

    def run_op(self, op: Op, inputs: list[np.ndarray], env: dict[Value, np.ndarray]) -> None:
        try:
            outputs = OP_DEFS[op.name].evaluate(op, inputs, self.ctx)
        except IndexError as error:
            if op.name != "ac.gather" or op.loc is None:
                raise
            raise IndexError(with_location(str(error), str(op.loc))) from None
        for value, array in zip(op.results, outputs):
            array = np.asarray(array, dtype=float64_like(value.type.dtype))
            env[value] = array
            self.record(value, array)

    def run(self, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
        self.outer: dict[Value, np.ndarray] = {}
        inputs = [np.asarray(a, dtype=float64_like(v.type.dtype)) for a, v in zip(arrays, self.func.args)]
        return self.run_block(self.func.body, inputs)


def interpret_unrounded(func: Func, args: Sequence[Any], constraints=None, sizes: dict[str, int] | None = None):
    """Run ``func`` on the arguments as given, float64 ones unrounded to the declared types (sizes
    and element kinds are still checked against them); return every result, in float64."""
    from attncomp.ir.types import NUMPY_DTYPES

    declared = [np.asarray(a).astype(NUMPY_DTYPES[v.type.dtype]) for a, v in zip(args, func.args)]
    constraints = verify_func(func) if constraints is None else constraints
    _, env = bind_arguments(func, declared, constraints, sizes)
    return Interpreter(func, env).run([np.asarray(a) for a in args])


def interpret_func(func: Func, args: Sequence[Any], trace: bool = False, sizes: dict[str, int] | None = None):
    """Bind ``args`` (and caller-known ``sizes``) to ``func``, run it, return its results (and the trace)."""
    constraints = verify_func(func)
    arrays, env = bind_arguments(func, args, constraints, sizes)
    interp = Interpreter(func, env, trace)
    outputs = interp.run(arrays)
    result = outputs[0] if len(outputs) == 1 else tuple(outputs)
    return (result, interp.values) if trace else result
