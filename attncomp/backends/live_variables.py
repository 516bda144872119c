"""The variables live at each block's entry, found with a work list.

Numba's front end recomputes variable lifetimes after most passes that change a function's IR
(``PostProcessor.run``: nine times for a CUDA kernel, more for a CPU one), and each time
``analysis.compute_live_map`` sweeps every block until no set grows: once forward for the
definitions that reach a block, then backward for the variables live at its entry.  The
backward problem swept in block order took some 50 sweeps over a tensor-core backward kernel's
115 blocks each time.  :func:`compute_live_map` solves the same equations with a work list,
revisiting a block only when a neighbour's set grew (the bf16 deterministic backward's two
largest kernels: 8.3 s to 7.1 s to compile), and holds each set as the bits of an int, so that a
union or difference of sets of hundreds of names is one operation on a few machine words.  Both
reach the least solution of the same monotone equations, so the sets are the same
(``tests/backends/test_live_variables.py`` compares them on a CPU and a CUDA kernel).

:func:`install` gives Numba's or numba-cuda's analysis module this version (their post-
processors look it up on the module at each call).
"""

from __future__ import annotations

import importlib
from collections import defaultdict, deque
from typing import Any

from attncomp.backends import replaced

#: the modules whose ``compute_live_map`` is replaced
MODULES = ("numba.core.analysis", "numba.cuda.core.analysis")


def compute_live_map(cfg: Any, blocks: dict, var_use_map: dict, var_def_map: dict) -> dict:
    """The variables that must be alive at the entry of each block (Numba's ``compute_live_map``,
    the same sets)."""
    names = _Names()
    defs = {block: names.bits(var_def_map[block]) for block in var_def_map}
    uses = {block: names.bits(var_use_map[block]) for block in var_use_map}
    # forward: what is defined (or used) in a block, and reaches the blocks after it
    reach: dict = defaultdict(int)
    work = deque(var_def_map)
    queued = set(work)
    while work:
        block = work.popleft()
        queued.discard(block)
        here = reach[block] = reach[block] | defs[block] | uses[block]
        for successor, _ in cfg.successors(block):
            after = reach[successor]
            grown = after | here
            if grown != after:
                reach[successor] = grown
                if successor in var_def_map and successor not in queued:
                    work.append(successor)
                    queued.add(successor)
    # backward: what a block uses, live in its predecessors where it reaches them undefined there
    live = {block: uses[block] for block in blocks}
    work = deque(live)
    queued = set(work)
    while work:
        block = work.popleft()
        queued.discard(block)
        for predecessor, _ in cfg.predecessors(block):
            before = live[predecessor]
            grown = before | (live[block] & reach[predecessor] & ~defs[predecessor])
            if grown != before:
                live[predecessor] = grown
                if predecessor not in queued:
                    work.append(predecessor)
                    queued.add(predecessor)
    return {block: names.names(bits) for block, bits in live.items()}


class _Names:
    """Sets of variable names as the bits of an int: one bit a name, numbered as first met (the
    equations' unions, intersections and differences each one operation on machine words)."""

    def __init__(self) -> None:
        self.index: dict = {}
        self.order: list = []

    def bits(self, names: set) -> int:
        index = self.index
        marks = bytearray((len(index) + len(names)) // 8 + 1)
        for name in names:
            k = index.get(name)
            if k is None:
                k = index[name] = len(self.order)
                self.order.append(name)
            marks[k >> 3] |= 1 << (k & 7)
        return int.from_bytes(marks, "little")

    def names(self, bits: int) -> set:
        order = self.order
        found = set()
        text = bin(bits)
        top = len(text) - 1
        k = text.find("1", 2)
        while k != -1:
            found.add(order[top - k])
            k = text.find("1", k + 1)
        return found


def install(module: str) -> None:
    """Replace ``compute_live_map`` in Numba's analysis module ``module`` (one of :data:`MODULES`;
    idempotent): the cpu backend installs Numba's, the cuda backend numba-cuda's, so neither
    imports the other's compiler."""
    replaced.replace(importlib.import_module(module), "compute_live_map", lambda _: compute_live_map)


def original(module: str) -> Any:
    """The ``compute_live_map`` that :func:`install` replaced in ``module`` (None if it did not)."""
    return replaced.original(replaced.module(module), "compute_live_map")
