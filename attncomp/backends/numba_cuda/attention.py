"""The attention kernels of one ``ac.tile_grid``: one per head-dim pair, made on first use.

A kernel keeps its query and accumulator slices in named registers, so the
head dims D and E are compile-time constants: the first call with new head
dims generates and compiles that kernel (the source is cached on disk by its
text, and Numba caches the compiled kernel beside it); other sizes (batch,
heads, sequence lengths) never recompile.
"""

from __future__ import annotations

from typing import Any

from attncomp.backends.cache import load_source
from attncomp.backends.codegen import size_names
from attncomp.backends.numba_cpu import captured_values
from attncomp.backends.numba_cuda.graph_kernels import SCALAR_ARG, array_type
from attncomp.backends.numba_cuda.kernel import write_attention_kernel
from attncomp.backends.numba_cuda.plan import AttentionPlan, plan_attention
from attncomp.backends.tiles import read_tiled_attention
from attncomp.ir.core import Func, Op
from attncomp.ir.dims import Dim


class AttentionKernels:
    def __init__(self, index: int, grid: Op, func: Func, lanes: int | None = None):
        self.index = index
        self.grid = grid
        self.tiled = read_tiled_attention(grid)
        self.captured = {v: f"arg_{n}" for n, v in enumerate(captured_values(grid))}
        self.dims = size_names(func)
        self.func_name = func.name
        self.name = f"attention_kernel_{index}"
        self.lanes = lanes
        self._kernels: dict[tuple[int, int], Any] = {}

    @property
    def head_dims(self) -> tuple[Dim, Dim]:
        """D and E as the IR has them: the query tile's and the value tile's last axes."""
        return self.tiled.q_load.results[0].type.shape[-1], self.tiled.masked.v_load.results[0].type.shape[-1]

    def plan(self, head_dim: int, value_dim: int) -> AttentionPlan:
        acc_bytes = 8 if self.grid.results[0].type.dtype == "f64" else 4
        t = self.tiled
        return plan_attention(t.block_q, t.block_k, head_dim, value_dim, acc_bytes, self.lanes)

    def source(self, head_dim: int, value_dim: int) -> str:
        plan = self.plan(head_dim, value_dim)
        return write_attention_kernel(self.name, self.func_name, self.tiled, self.captured, self.dims, plan)

    def signature(self) -> str:
        """The Numba signature the PTX is compiled for (arrays of any layout, results C-contiguous)."""
        types = [array_type(r.type.dtype, r.type.rank, contiguous=True) for r in self.grid.results]
        for value in self.captured:
            rank = value.type.rank
            types.append(SCALAR_ARG[value.type.dtype] if rank == 0 else array_type(value.type.dtype, rank))
        types += ["int64"] * len(self.dims)
        return f"void({', '.join(types)})"

    def kernel(self, head_dim: int, value_dim: int) -> Any:
        key = (head_dim, value_dim)
        if key not in self._kernels:
            module = load_source(self.source(head_dim, value_dim), "cuda")
            self._kernels[key] = getattr(module, self.name)
        return self._kernels[key]

    @property
    def specialised(self) -> list[tuple[int, int]]:
        """The (D, E) pairs compiled so far."""
        return list(self._kernels)

    def launch(self, blocks: int, head_dim: int, value_dim: int, *args: Any) -> None:
        if blocks <= 0:
            return
        threads = self.plan(head_dim, value_dim).threads
        self.kernel(head_dim, value_dim)[blocks, threads](*args)
