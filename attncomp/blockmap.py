"""``fn.block_map(*args)``: how each (query block, key block) tile was handled.

The final IR runs in the interpreter with a recorder attached: tiles that a
key loop never visits (tightened bounds) stay 0, visited tiles take the class
their ``ac.switch {tile_class = true}`` chose, or the loop's default (1, the
mask is evaluated, or 2 when mask-elimination found no mask at all).  Only
the classification runs, not the tiles' work, so a map at T = 8192 is cheap.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from attncomp.errors import AttncompError
from attncomp.ir.binding import bind_arguments
from attncomp.ir.core import Func
from attncomp.ir.interpreter import Interpreter


class BlockRecorder:
    """Receives tile positions from the interpreter's tile ops."""

    def __init__(self, classify_only: bool = True) -> None:
        #: skip the tiles' work: only the classification is wanted, not the result
        self.classify_only = classify_only
        self.grids: dict[Any, dict[tuple, int]] = {}
        self.shapes: dict[Any, tuple[int, ...]] = {}
        self.grid = None
        self.query: tuple = ()
        self.tile: tuple | None = None

    def enter_query_block(self, grid: Any, position: tuple, q_block: int, grid_shape: tuple) -> None:
        """``grid_shape`` is ``(*batch, q_blocks)``."""
        self.grid = grid
        self.grids.setdefault(grid, {})
        self.query = tuple(position) + (q_block,)
        self.grid_shape = grid_shape

    def enter_key_block(self, k_block: int, k_blocks: int, default: int) -> None:
        self.tile = self.query + (k_block,)
        self.grids[self.grid][self.tile] = default
        self.shapes[self.grid] = self.grid_shape + (k_blocks,)

    def record(self, tile_class: int) -> None:
        self.grids[self.grid][self.tile] = tile_class

    def block_map(self, grid: Any, batch_shape: tuple[int, ...], q_blocks: int, k_blocks: int = 0) -> np.ndarray:
        """``[*batch, q_blocks, k_blocks]``; ``k_blocks`` where no key loop ran (every tile skipped)."""
        shape = self.shapes.get(grid, tuple(batch_shape) + (q_blocks, k_blocks))
        out = np.zeros(shape, dtype=np.int8)
        for index, tile_class in self.grids.get(grid, {}).items():
            out[index] = tile_class
        return out


def block_map(func: Func, constraints, args: tuple[Any, ...], sizes: dict[str, int] | None = None) -> np.ndarray:
    """The tile classes of the first tiled attention in ``func`` for these inputs.

    ``sizes`` binds sizes no argument carries (a chunk's offsets).

    In a backward (``ac.key_grid``: key blocks outside, query blocks inside) the
    map is transposed back, so it reads as the forward's: ``[*batch, q_blocks, kv_blocks]``.
    """
    grids = [op for op in func.body.ops if op.name in ("ac.tile_grid", "ac.key_grid")]
    if not grids:
        raise AttncompError("block_map needs tiled attention: compile with the flash-tiling pass")
    arrays, env = bind_arguments(func, args, constraints, sizes)
    interp = Interpreter(func, env)
    recorder = BlockRecorder()
    interp.ctx.recorder = recorder
    interp.run(arrays)
    grid = grids[0]
    if grid.name == "ac.key_grid":
        dq_shape = grid.results[0].type.concrete_shape(env)
        keys = grid.results[1].type.concrete_shape(env)[-2]
        loops = [o for o in grid.regions[0].ops if o.name == "ac.tile_for"]
        q_blocks = -(-dq_shape[-2] // loops[0].attrs["block_q"]) if loops else 0
        k_blocks = -(-keys // grid.attrs["block_k"])
        shape = tuple(dq_shape[:-2]) + (k_blocks, q_blocks)
        out = np.zeros(shape, dtype=np.int8)
        for index, tile_class in recorder.grids.get(grid, {}).items():
            out[index] = tile_class
        return np.swapaxes(out, -1, -2)
    out_shape = grid.results[0].type.concrete_shape(env)
    rows = out_shape[-2]
    block_q = grid.attrs["block_q"]
    # the key blocks of the grid, whether or not a key loop ran (tightened bounds may skip them all)
    loops = [o for o in grid.regions[0].walk() if o.name == "ac.tile_for" and "extent" in o.attrs]
    k_blocks = int(loops[0].attrs["extent"].evaluate(env)) if loops else 0
    return recorder.block_map(grid, out_shape[:-2], -(-rows // block_q), k_blocks)
