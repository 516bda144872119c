"""numba-cuda's search for singly assigned variables, in one pass over each block.

Before lowering a kernel, numba-cuda's ``Lower._find_singly_assigned_variable`` (0.30) finds the
variables defined once, in one block, and used only there (they live in registers, not stack
slots).  For each candidate it lists every assignment of its block again, so a block of ``n``
statements costs ``n`` times the block: the tensor-core kernels' straight-line blocks are thousands
of statements long, and the scan was some 14% of compiling a bf16 forward kernel (9.1 s against
7.8 s for the D = 128 one).  Numba's own CPU lowering (0.68) counts the assignments once per
block; :func:`install` gives numba-cuda's lowering that version.  The set it finds is the same
(``tests/backends/test_cuda_ptx.py`` compares both on a kernel), so the PTX is too.

Installed when the backend builds a program or compiles PTX, and only where numba-cuda's method is
the scanning one this replaces (a numba-cuda that counts per block, or lowers otherwise, keeps its
own).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from attncomp.backends import replaced

#: the names the scanning method reads, by which :func:`install` recognises it
_SCANNING = {"find_insts", "compute_use_defs", "must_use_alloca", "assign_types"}


def singly_assigned(lower: Any) -> set[str]:
    """The variables of ``lower``'s function defined in exactly one statement of one block and used
    only in that block (none in a generator), as numba-cuda's method finds them."""
    from numba.cuda.core import ir
    from numba.cuda.core.analysis import compute_use_defs, must_use_alloca

    found: set[str] = set()
    if lower.func_ir.func_id.is_generator:
        return found
    blocks = lower.func_ir.blocks
    use_defs = compute_use_defs(blocks)
    alloca = must_use_alloca(blocks)
    defined_in: dict[str, set[int]] = defaultdict(set)
    for label, names in use_defs.defmap.items():
        for name in names:
            defined_in[name].add(label)
    used_elsewhere: set[str] = set()  # the use map holds the uses before a block's own definition
    for names in use_defs.usemap.values():
        used_elsewhere.update(names)
    assignments: dict[int, dict[str, int]] = {}
    for label, block in lower.blocks.items():
        counts: dict[str, int] = defaultdict(int)
        for stmt in block.find_insts(ir.assign_types):
            counts[stmt.target.name] += 1
        assignments[label] = counts
    for name, labels in defined_in.items():
        if name in alloca or len(labels) != 1 or name in used_elsewhere:
            continue
        (label,) = labels
        if assignments[label][name] == 1:
            found.add(name)
    return found


def _find_singly_assigned_variable(self) -> None:
    self._singly_assigned_vars = singly_assigned(self)
    self._blk_local_varmap = {}


def original() -> Any:
    """numba-cuda's own method where :func:`install` replaced it, else None."""
    try:
        from numba.cuda import lowering
    except ImportError:
        return None
    return replaced.original(lowering.Lower, "_find_singly_assigned_variable")


def install() -> bool:
    """Give numba-cuda's lowering the one-pass search; whether it has it now.  Idempotent."""
    try:
        from numba.cuda import lowering
    except ImportError:  # no numba-cuda, or one laid out otherwise
        return False
    current = getattr(lowering.Lower, "_find_singly_assigned_variable", None)
    if current is _find_singly_assigned_variable:
        return True
    if current is None or not _SCANNING <= set(current.__code__.co_names):
        return False
    replaced.replace(lowering.Lower, "_find_singly_assigned_variable", lambda _: _find_singly_assigned_variable)
    return True
