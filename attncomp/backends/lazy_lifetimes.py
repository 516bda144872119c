"""Variable lifetimes computed when a pass reads them, while attncomp compiles its kernels.

Numba's front end runs its post-processor after most passes that may change a function's IR
(``PostProcessor.run``: nine passes call it, once per function each; 144 runs for the 15
functions of a causal ALiBi cpu module, 34 for a bf16 tensor-core forward kernel).  Each run
canonicalises the control flow, then computes every block's uses and definitions, the live and
dead variables, and from them the variables live at each block's entry (``block_entry_vars``).
Only three of the nine callers go on to insert ``del`` statements, which need the dead
variables.  The entry sets are read by object-mode lowering and by a generator's yield points
only: a kernel compiled in nopython mode, not a generator, never reads them.

Inside :func:`attncomp.backends.call_types.remembered` (attncomp's compile window, where only its
generated kernels compile, all in nopython mode), :func:`install` makes a run on a function that
is not a generator canonicalise the control flow, leave the lifetimes (``variable_lifetime``,
already a set of lazily computed properties in Numba) to be computed from the run's blocks when
a pass reads them, insert ``del`` statements where asked (reading them at once), and leave the
entry sets empty: a read of one raises ``KeyError``, never a stale set.  Any other run is
Numba's own.  ``tests/backends/test_front_end.py`` compares a cpu module's LLVM IR and a
CUDA kernel's PTX compiled with the window and without.
"""

from __future__ import annotations

import importlib
from typing import Any

from attncomp.backends import call_types, replaced

#: the post-processor modules whose ``PostProcessor.run`` is replaced
MODULES = ("numba.core.postproc", "numba.cuda.core.postproc")


def install(module: str) -> None:
    """Replace ``PostProcessor.run`` in Numba's post-processor module ``module`` (one of
    :data:`MODULES`; idempotent): outside attncomp's compile window it is Numba's own."""
    found = importlib.import_module(module)
    transforms = importlib.import_module(f"{module.rsplit('.', 1)[0]}.transforms")
    replaced.replace(found.PostProcessor, "run", lambda original: _lazy(found, transforms, original))


def _lazy(found: Any, transforms: Any, original: Any) -> Any:
    """``PostProcessor.run`` of the module ``found``, lifetimes left to be computed when read."""

    def run(self: Any, emit_dels: bool = False, extend_lifetimes: bool = False) -> None:
        func_ir = self.func_ir
        if not call_types.compiling() or func_ir.is_generator:
            return original(self, emit_dels, extend_lifetimes)
        func_ir.blocks = transforms.canonicalize_cfg(func_ir.blocks)
        # over a copy of the block table, which later passes add blocks to and drop blocks from
        func_ir.variable_lifetime = found.VariableLifetime(dict(func_ir.blocks))
        func_ir.block_entry_vars = {}
        func_ir.generator_info = None
        if emit_dels:
            self._insert_var_dels(extend_lifetimes=extend_lifetimes)

    return run


def original(module: str) -> Any:
    """The ``PostProcessor.run`` that :func:`install` replaced in ``module`` (None if it did not)."""
    found = replaced.module(module)
    return None if found is None else replaced.original(found.PostProcessor, "run")
