"""Numba's per-function LLVM passes left to the module's, while attncomp compiles its cpu kernels.

Numba's CPU code generator optimises every LLVM module a function lowers to three times: each
function by itself as the module is added to its library (``CPUCodeLibrary._optimize_functions``,
LLVM's function simplification pipeline at ``NUMBA_OPT``), then the library's final module with
a cheaper module pipeline (to inline what reference-count pruning needs together) and with the
full one, which runs the function simplification pipeline over every function again.  For a
kernel module's task the first of the three was a fifth of its compile (three specs' modules:
6.7-7.0 s with it, 5.3-5.5 s without), and the machine code the full pipeline then makes runs
at the same speed (the causal, soft-capped and ALiBi forwards at T = 2048, alternated: 24.4 and
24.4 ms, 28.1 and 28.6, 9.3 and 9.1; vectorised alike).

Inside attncomp's compile window (:func:`attncomp.backends.call_types.compiling`), :func:`install`
makes ``_optimize_functions`` set the module's data layout (which Numba's does first) and leave
the passes to the final module's pipelines; outside it, a user's own Numba function is optimised
as Numba does.  The tests of the cpu kernels' machine code (``tests/backends/test_cpu.py``,
``test_vector_loops.py``) hold them to what they were: no call to an exp2 left, the vectorised
bf16 and 8-bit products.
"""

from __future__ import annotations

from typing import Any

from attncomp.backends import call_types, replaced


def install() -> None:
    """Replace ``CPUCodeLibrary._optimize_functions`` in Numba's code generator (idempotent)."""
    from numba.core import codegen

    replaced.replace(codegen.CPUCodeLibrary, "_optimize_functions", _module_passes_only)


def _module_passes_only(original: Any) -> Any:
    def _optimize_functions(self: Any, ll_module: Any) -> None:
        if not call_types.compiling():
            return original(self, ll_module)
        ll_module.data_layout = self._codegen._data_layout

    return _optimize_functions


def original() -> Any:
    """The ``_optimize_functions`` that :func:`install` replaced (None if it did not)."""
    from numba.core import codegen

    return replaced.original(codegen.CPUCodeLibrary, "_optimize_functions")
