"""CUDA kernels for the ops outside tiled attention, generated one per op.

Projections, norms, rotary embeddings and every op of an unfused graph run
on the device, each as a small ``numba.cuda.jit`` kernel written from the
op's types (ranks and broadcasting are static; sizes are read from the
arrays, so kernels are shape-generic):

- **map** kernels (elementwise ops, ``where``, ``cast``, ``iota``, tensor
  constants, ``gather``, and the layout ops ``transpose``, ``slice``,
  ``repeat_kv``, ``concat``, ``cache_append``, a reshape copy): one element
  per iteration of a grid-stride loop.  The element's scalar code is the
  same :class:`ScalarEmitter` output the attention kernels use.
- **row** kernels (``reduce``, ``softmax``, ``logsumexp``, ``block_reduce``):
  one output element (or row) per iteration, the reduced axes looped over.
- **matmul**: 16 x 16 tiles of both operands staged in shared memory.

A 0-d result of a device op is written to a one-element array the driver
reads back: 0-d values live on the host.
"""

from __future__ import annotations

from attncomp.backends.numba_cuda.host.graph_kernel_writer import GraphKernel
from attncomp.backends.numba_cuda.host.map_kernels import ELEMENTWISE, LAYOUT, elementwise_kernel, layout_kernel
from attncomp.backends.numba_cuda.host.reduction_kernels import ROWS, matmul_kernel, row_kernel
from attncomp.backends.tiles import LoweringError
from attncomp.ir.core import Op


def graph_kernel(name: str, op: Op) -> GraphKernel:
    """The kernel computing ``op``'s result on the device."""
    if op.name in ELEMENTWISE:
        return elementwise_kernel(name, op)
    if op.name in LAYOUT:
        return layout_kernel(name, op)
    if op.name in ROWS:
        return row_kernel(name, op)
    if op.name == "ac.matmul":
        return matmul_kernel(name, op)
    raise LoweringError(f"the cuda backend cannot lower {op.name} outside a tile grid")
