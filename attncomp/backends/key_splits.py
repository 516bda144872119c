"""Key splits at fixed positions: the parts of a batch-invariant grid, written once for every kernel.

A grid with ``key_split = N`` (flash-tiling's ``batch_invariant``) splits each unit's keys into
parts at multiples of ``N`` positions, ``N // block_k`` key blocks each, whatever the launch's
size; a launch runs ``ceil(key blocks / blocks per part)`` parts of every unit.  A unit whose
keys lie within one part finishes in that part, as an unsplit unit does; a unit spanning several
stores each part's ``(m, l, acc)`` and merges exactly those parts, in part order.  Which parts a
unit has, and so every sum a row's output is made of, depends on the row's own key range alone:
not on the batch, the other sequences of a step, the number of threads or thread blocks, or
the longest sequence of a ragged batch (whose parts past a unit's keys are neither run nor merged).

The CPU kernel (``numba_cpu/kernel.py``) and the CUDA kernels (``numba_cuda/simt/forward_kernel.py``,
which the tensor-core writers extend) write these lines into their generated source.
"""

from __future__ import annotations

from attncomp.backends.codegen import SourceWriter
from attncomp.ir.core import Op


def split_blocks(grid: Op, block_k: int) -> int | None:
    """Key blocks per part of a batch-invariant ``grid`` (its ``key_split``), or None (splits chosen by
    the launch)."""
    keys = grid.attrs.get("key_split")
    if keys is None:
        return None
    if keys % block_k:
        raise ValueError(f"ac.tile_grid: key_split = {keys} is not a multiple of the key blocks ({block_k})")
    return keys // block_k


def fixed_split_count(n_keys: int, block_k: int, blocks: int) -> int:
    """The parts a launch over ``n_keys`` keys runs per unit: enough for the longest row, at least one."""
    return max(1, (-(-n_keys // block_k) + blocks - 1) // blocks)


def write_unit_parts(w: SourceWriter, lo: str, hi: str, blocks: int) -> None:
    """``own_first``, ``own_parts``: the parts that unit's key blocks ``[lo, hi)`` touch."""
    w.line(f"own_first = {lo} // {blocks}  # the unit's parts: fixed by its own key range")
    w.line(f"own_parts = ({hi} + {blocks - 1}) // {blocks} - own_first if {hi} > {lo} else 0")


def write_part_range(w: SourceWriter, lo: str, hi: str, part: str, blocks: int) -> None:
    """The unit's parts (:func:`write_unit_parts`), then ``[lo, hi)`` narrowed to part ``part``'s key
    blocks; ``stores_part``: this part holds a share of a split unit (it stores its state);
    ``finishes``: the unit is not split and this part writes its output (its one part, or part 0 of
    a unit with no key block)."""
    write_unit_parts(w, lo, hi, blocks)
    w.line(f"{lo} = max({lo}, {part} * {blocks})")
    w.line(f"{hi} = min({hi}, ({part} + 1) * {blocks})")
    w.line(f"stores_part = own_parts > 1 and own_first <= {part} and {part} < own_first + own_parts")
    w.line(f"finishes = own_parts <= 1 and {part} == (own_first if own_parts == 1 else 0)")
