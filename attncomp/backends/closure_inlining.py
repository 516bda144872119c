"""Numba's closure inliner left out for a function it could find nothing in, while attncomp compiles
its kernels.

Before typing, Numba's front end runs ``InlineClosureLikes`` on every function: the inliner
(``InlineClosureCallPass``) resolves every call looking for a call of a closure the function
defines (a ``make_function``), a call of ``functools.reduce``, and loops that build a list by
``append`` for ``np.array``; then the pass runs the post-processor again and defines every
variable each block uses in the block's scope (``fixup_var_define_in_scope``), for the blocks an
inlined body brought.  A function with no code object among its constants (no nested function,
lambda or comprehension: no ``make_function``), neither ``append`` nor ``reduce`` among its names
and no global or free variable that is ``functools.reduce`` gives the inliner nothing to do, and
its blocks keep the one scope that defines all their variables.  attncomp's generated kernels are such functions:
the pass was 4% of a PTX check's compile.

Inside :func:`attncomp.backends.call_types.remembered` (attncomp's compile window), :func:`install`
makes the pass, for such a function, run the post-processor only; any other function, and every
function outside the window, gets Numba's own pass.  ``tests/backends/test_front_end.py`` compares
a cpu task's LLVM IR and a CUDA kernel's PTX compiled with the pass left out and with Numba's.
"""

from __future__ import annotations

import functools
import importlib
import types
from typing import Any

from attncomp.backends import call_types, replaced

#: the untyped-pass modules whose ``InlineClosureLikes.run_pass`` is replaced
MODULES = ("numba.core.untyped_passes", "numba.cuda.core.untyped_passes")


def install(module: str) -> None:
    """Replace ``InlineClosureLikes.run_pass`` in ``module`` (one of :data:`MODULES`; idempotent)."""
    found = importlib.import_module(module)
    postproc = importlib.import_module(f"{module.rsplit('.', 1)[0]}.postproc")
    replaced.replace(found.InlineClosureLikes, "run_pass", lambda original: _skipping(postproc, original))


def nothing_to_inline(function: Any) -> bool:
    """Whether Numba's inliner can find nothing in ``function``: it defines no function (no code
    object among its constants), names no ``append`` or ``reduce`` and reaches no
    ``functools.reduce`` by another name."""
    code = getattr(function, "__code__", None)
    if code is None or any(isinstance(c, types.CodeType) for c in code.co_consts):
        return False
    if {"append", "reduce"} & set(code.co_names):  # ``functools.reduce``, or imported by that name
        return False
    names = function.__globals__
    cells = [cell.cell_contents for cell in function.__closure__ or () if _filled(cell)]
    return not any(value is functools.reduce for value in [*(names.get(n) for n in code.co_names), *cells])


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018 (an empty cell raises)
    except ValueError:
        return False
    return True


def _skipping(postproc: Any, original: Any) -> Any:
    """``InlineClosureLikes.run_pass``, the inliner left out where :func:`nothing_to_inline` holds."""

    def run_pass(self: Any, state: Any) -> bool:
        if not call_types.compiling() or not nothing_to_inline(state.func_id.func):
            return original(self, state)
        postproc.PostProcessor(state.func_ir).run()
        return True

    return run_pass


def original(module: str) -> Any:
    """The ``InlineClosureLikes.run_pass`` that :func:`install` replaced in ``module`` (None if it did not)."""
    found = replaced.module(module)
    return None if found is None else replaced.original(found.InlineClosureLikes, "run_pass")
