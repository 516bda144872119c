"""Checks that a module is well formed and well typed.

Every op must be known, use only values defined before it (or in an enclosing
region), and carry the result types its type rule gives.  A failure names the
op and its line and reprints the ops around it.  The dimension equalities
that could not be decided symbolically are returned, to be checked when the
sizes are bound.
"""

from __future__ import annotations

from attncomp.errors import TypeCheckError, VerifyError
from attncomp.ir.core import Block, Func, Module, Op, Value
from attncomp.ir.ops import OP_DEFS, Checker, DimConstraint
from attncomp.ir.printer import print_func_lines

CONTEXT_LINES = 2


def context(func: Func, op: Op | None, message: str) -> str:
    """``message`` followed by the printed ops around ``op``, the culprit marked."""
    if op is None:
        return message
    lines, op_line = print_func_lines(func)
    if op not in op_line:
        return message
    at = op_line[op]
    lo, hi = max(0, at - CONTEXT_LINES), min(len(lines), at + CONTEXT_LINES + 1)
    shown = [("> " if k == at else "  ") + f"{k + 1:4d} | {lines[k]}" for k in range(lo, hi)]
    return f"line {at + 1}: {message}\n" + "\n".join(shown)


class _FuncVerifier:
    def __init__(self, func: Func):
        self.func = func
        self.checker = Checker()

    def fail(self, op: Op | None, message: str) -> VerifyError:
        return VerifyError(context(self.func, op, f"@{self.func.name}: {message}"))

    def run(self) -> list[DimConstraint]:
        named = {d.symbol for arg in self.func.args for d in arg.type.shape if d.is_symbol}
        for arg in self.func.args:
            for d in arg.type.shape:
                if not (d.is_symbol or d.is_const) and not d.symbols() <= named:
                    raise self.fail(
                        None,
                        f"argument type {arg.type}: an expression such as {d} may only use names "
                        "that some argument's type has as a plain dimension",
                    )
        self.block(self.func.body, set(), "ac.return")
        return self.checker.constraints

    def block(self, block: Block, visible: set[Value], terminator: str) -> None:
        visible = visible | set(block.args)
        if not block.ops or block.ops[-1].name != terminator:
            last = block.ops[-1] if block.ops else None
            raise self.fail(last, f"a block must end with {terminator}")
        for op in block.ops:
            self.op(op, visible, is_last=op is block.ops[-1])
            visible |= set(op.results)

    def op(self, op: Op, visible: set[Value], is_last: bool) -> None:
        opdef = OP_DEFS.get(op.name)
        if opdef is None:
            raise self.fail(op, f"unknown op '{op.name}'")
        if opdef.terminator and not is_last:
            raise self.fail(op, f"{op.name} must be the last op of its block")
        for k, value in enumerate(op.operands):
            if value not in visible:
                raise self.fail(op, f"{op.name}: operand {k} is used before it is defined")
        declared = [r.type for r in op.results]
        try:
            inferred = opdef.infer(
                [v.type for v in op.operands],
                op.attrs,
                declared if opdef.declared_result else None,
                self.checker,
            )
        except TypeCheckError as exc:
            raise self.fail(op, str(exc)) from None
        if inferred != declared:
            want = ", ".join(map(str, inferred)) or "no results"
            got = ", ".join(map(str, declared)) or "no results"
            raise self.fail(op, f"{op.name}: result types should be {want}, not {got}")
        for region in op.regions:
            self.block(region, visible, "ac.yield")
        try:
            opdef.verify_regions(op)
        except TypeCheckError as exc:
            raise self.fail(op, str(exc)) from None


def verify_func(func: Func) -> list[DimConstraint]:
    return _FuncVerifier(func).run()


def verify_module(module: Module) -> list[DimConstraint]:
    """Verify every function; return the run-time dimension constraints."""
    constraints: list[DimConstraint] = []
    for func in module.funcs:
        constraints += verify_func(func)
    return constraints
