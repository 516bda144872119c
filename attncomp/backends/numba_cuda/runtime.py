"""What a generated CUDA driver calls as ``rt``: its header imports this module by this path
(``from attncomp.backends.numba_cuda import runtime as rt``), so the path stays while the helpers
live in ``host/``: device memory in ``host/arrays.py``, launches in ``host/launches.py``.  The
host side's own modules import them from there."""

from attncomp.backends.numba_cuda.host.arrays import (
    cast,
    check_indices,
    check_pages,
    empty,
    from_host,
    gather_flags,
    host_value,
    is_contiguous,
    is_device,
    narrow,
    prefix,
    result,
    to_device,
    transposed,
    zeros,
)
from attncomp.backends.numba_cuda.host.launches import launch_map, launch_matmul, work
from attncomp.backends.scalars import kernel_scalar
from attncomp.ir.ops.structural import check_index_range

__all__ = [
    "cast",
    "check_index_range",
    "check_indices",
    "check_pages",
    "empty",
    "from_host",
    "gather_flags",
    "host_value",
    "is_contiguous",
    "is_device",
    "kernel_scalar",
    "launch_map",
    "launch_matmul",
    "narrow",
    "prefix",
    "result",
    "to_device",
    "transposed",
    "work",
    "zeros",
]
