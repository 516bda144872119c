"""Naming traced values after the spec's own variables.

Each op remembers the source line it was traced from.  The statement holding
that line tells which variable the value was assigned to: in ``s = (q @ k.mT)
* scale`` the last op of the statement (the multiply) is named ``s``.  A
tuple target names the statement's last ops in order; a returned expression
is named ``out``.  Values of statements without a plain target stay numbered.
"""

from __future__ import annotations

import ast
import functools
import linecache
from dataclasses import dataclass
from itertools import groupby

from attncomp.ir.core import Func, Op


@dataclass(frozen=True)
class Statement:
    start: int
    end: int
    targets: tuple[str, ...]


def _target_names(target: ast.expr) -> tuple[str, ...] | None:
    if isinstance(target, ast.Name):
        return (target.id,)
    if isinstance(target, (ast.Tuple, ast.List)) and all(isinstance(e, ast.Name) for e in target.elts):
        return tuple(e.id for e in target.elts)  # type: ignore[attr-defined]
    return None


@functools.lru_cache(maxsize=64)
def _statements(filename: str) -> tuple[Statement, ...]:
    source = "".join(linecache.getlines(filename))
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return ()
    found = []
    for node in ast.walk(tree):
        names: tuple[str, ...] | None = None
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            names = _target_names(node.targets[0])
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            names = _target_names(node.target)
        elif isinstance(node, ast.Return) and node.value is not None:
            names = None if isinstance(node.value, ast.Tuple) else ("out",)
        if names:
            found.append(Statement(node.lineno, node.end_lineno or node.lineno, names))
    return tuple(found)


def _statement_of(op: Op) -> Statement | None:
    if op.loc is None:
        return None
    for stmt in _statements(op.loc.file):
        if stmt.start <= op.loc.line <= stmt.end:
            return stmt
    return None


def name_values(func: Func) -> None:
    """Give op results of ``func`` name hints from the statements that made them."""
    runs = groupby(func.body.ops, key=lambda op: (op.loc.file if op.loc else None, _statement_of(op)))
    for (_, stmt), group in runs:
        if stmt is None:
            continue
        ops = [op for op in group if len(op.results) == 1]
        targets = stmt.targets
        if len(targets) > len(ops):
            continue
        for op, name in zip(ops[len(ops) - len(targets) :], targets):
            if op.results[0].name is None:
                op.results[0].name = name
