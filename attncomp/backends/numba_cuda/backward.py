"""The backward kernels of one ``ac.key_grid``: one per head-dim pair, made on first use.

As for the forward (``attention.py``), the dk and dv slices a thread keeps
are named registers, so D and E are compile-time constants: the first call
with new head dims generates and compiles that kernel; other sizes never
recompile.  Where the spec's query, key, value and output gradient are one
16-bit type the products run on tensor cores (``mma_backward_kernel.py``),
else on the scalar kernel (``backward_kernel.py``).  The driver zeroes the
outputs (every kernel adds into them) and launches one thread block per
query batch position, IR key block and part of a key block.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from attncomp.backends.backward_tiles import read_tiled_backward
from attncomp.backends.cache import load_source
from attncomp.backends.codegen import size_names
from attncomp.backends.numba_cpu import captured_values
from attncomp.backends.numba_cuda import runtime as rt
from attncomp.backends.numba_cuda.backward_kernel import write_backward_kernel
from attncomp.backends.numba_cuda.backward_plan import BackwardPlan, plan_backward
from attncomp.backends.numba_cuda.graph_kernels import SCALAR_ARG, array_type
from attncomp.backends.numba_cuda.mma_backward_kernel import MmaBackwardKernelWriter
from attncomp.backends.numba_cuda.mma_backward_plan import MmaBackwardPlan, plan_mma_backward
from attncomp.ir.core import Func, Op
from attncomp.ir.dims import Dim
from attncomp.ir.types import NUMPY_DTYPES, accumulation_dtype


class BackwardKernels:
    """The kernels of one ``ac.key_grid``; ``lanes`` fixes the threads per key of the scalar kernel
    (default: chosen, and tensor cores where ``element`` names their 16-bit type)."""

    def __init__(
        self,
        index: int,
        grid: Op,
        func: Func,
        lanes: int | None = None,
        element: str | None = None,
        storage: str = "f32",
    ):
        self.index = index
        self.grid = grid
        self.tiled = read_tiled_backward(grid)
        self.captured = {v: f"arg_{n}" for n, v in enumerate(captured_values(grid))}
        self.dims = size_names(func)
        self.func_name = func.name
        self.name = f"attention_backward_kernel_{index}"
        self.lanes = lanes
        #: the 16-bit type the products run in on tensor cores (None: the scalar kernel), and how the
        #: device holds the query, key, value and output gradient ("f16", or "f32": bf16 widened)
        self.element = None if lanes is not None else element
        self.storage = storage
        self._kernels: dict[tuple[int, int], Any] = {}

    @property
    def head_dims(self) -> tuple[Dim, Dim]:
        """D and E as the IR has them: the last axes of dq and dv."""
        return self.grid.results[0].type.shape[-1], self.grid.results[2].type.shape[-1]

    @property
    def acc_dtype(self) -> str:
        """The element type of the outputs the kernel adds into (float16 results are narrowed after)."""
        return accumulation_dtype(self.grid.results[0].type.dtype)

    def plan(self, head_dim: int, value_dim: int) -> BackwardPlan:
        acc_bytes = np.dtype(NUMPY_DTYPES[self.acc_dtype]).itemsize
        t = self.tiled
        return plan_backward(t.block_q, t.block_k, head_dim, value_dim, acc_bytes, self.lanes)

    def mma_plan(self, head_dim: int, value_dim: int) -> MmaBackwardPlan | None:
        """The tensor-core plan for these head dims, if the kernel has one."""
        t = self.tiled
        return plan_mma_backward(t.block_q, t.block_k, head_dim, value_dim, self.element, self.storage)

    def launch_plan(self, head_dim: int, value_dim: int) -> BackwardPlan | MmaBackwardPlan:
        """The plan a launch with these head dims runs: on tensor cores where it can."""
        return self.mma_plan(head_dim, value_dim) or self.plan(head_dim, value_dim)

    def source(self, head_dim: int, value_dim: int) -> str:
        mma = self.mma_plan(head_dim, value_dim)
        if mma is not None:
            writer = MmaBackwardKernelWriter(self.name, self.tiled, self.captured, self.dims, mma)
            return writer.write(self.func_name)
        plan = self.plan(head_dim, value_dim)
        return write_backward_kernel(self.name, self.func_name, self.tiled, self.captured, self.dims, plan)

    def signature(self) -> str:
        """The Numba signature the PTX is compiled for (outputs C-contiguous in the accumulation type)."""
        acc = self.acc_dtype
        types = [array_type(acc, max(r.type.rank, 1), contiguous=True) for r in self.grid.results]
        for value in self.captured:
            rank = value.type.rank
            types.append(SCALAR_ARG[value.type.dtype] if rank == 0 else array_type(value.type.dtype, rank))
        types += ["int64"] * len(self.dims)
        return f"void({', '.join(types)})"

    def kernel(self, head_dim: int, value_dim: int) -> Any:
        """The backward kernel for these head dims."""
        key = (head_dim, value_dim)
        if key not in self._kernels:
            self._kernels[key] = load_source(self.source(*key), "cuda")
        return getattr(self._kernels[key], self.name)

    @property
    def specialised(self) -> list[tuple[int, int]]:
        """The (D, E) pairs compiled so far."""
        return list(self._kernels)

    def launch(self, positions: int, n_keys: int, head_dim: int, value_dim: int, *args: Any) -> None:
        """Add the gradients of ``positions`` query batch positions into the zeroed outputs in ``args``
        (then the captured values and sizes)."""
        plan = self.launch_plan(head_dim, value_dim)
        blocks = positions * (-(-n_keys // plan.block_k)) * plan.parts * plan.halves
        if blocks <= 0:
            return
        self.kernel(head_dim, value_dim)[blocks, plan.threads, rt.stream()](*args)
