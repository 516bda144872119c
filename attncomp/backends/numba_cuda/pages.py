"""A paged decoder's pool in device memory: pages are written and copied by kernels, never moved.

``fn.paged_decoder`` on the cuda backend keeps each cached tensor as one
device array ``[num_pages, *heads, page_size, d]``; a step copies in only its
new tokens' keys and values (and the page tables), and the attention kernels
read the pages in place (``ac.page_view``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import cuda

from attncomp.backends.numba_cuda import runtime as rt


@cuda.jit(cache=True)
def _write_rows(pool, pages, slots, rows):
    """``pool[pages[c], h, slots[c], :] = rows[c, h, :]``; pool ``[num_pages, heads, size, d]``."""
    heads, d = rows.shape[1], rows.shape[2]
    per_row = heads * d
    for n in range(cuda.grid(1), rows.shape[0] * per_row, cuda.gridsize(1)):
        c = n // per_row
        rest = n - c * per_row
        h = rest // d
        e = rest - h * d
        pool[pages[c], h, slots[c], e] = rows[c, h, e]


@cuda.jit(cache=True)
def _copy_page(pool, dst, src):
    """``pool[dst] = pool[src]`` (a copy on write)."""
    size, d = pool.shape[2], pool.shape[3]
    per_head = size * d
    for n in range(cuda.grid(1), pool.shape[1] * per_head, cuda.gridsize(1)):
        h = n // per_head
        rest = n - h * per_head
        s = rest // d
        e = rest - s * d
        pool[dst, h, s, e] = pool[src, h, s, e]


def _flat(array: Any) -> Any:
    """The pool as ``[num_pages, heads, size, d]`` (GQA and multi-axis heads flattened), no copy."""
    shape = tuple(array.shape)
    heads = int(np.prod(shape[1:-2], dtype=np.int64))
    return array.reshape(shape[0], heads, shape[-2], shape[-1])


class DevicePages:
    """Where a :class:`~attncomp.serving.pool.PagePool` keeps its pages on the cuda backend."""

    def zeros(self, shape: tuple[int, ...], dtype: Any) -> Any:
        from attncomp.backends.numba_cuda import device_dtype

        return rt.zeros(tuple(shape), device_dtype(dtype))

    def write(self, array: Any, pages: np.ndarray, slots: np.ndarray, rows: np.ndarray) -> None:
        """Rows ``[count, *heads, d]`` (host) into their pages' slots: one copy in, one launch."""
        count = rows.shape[0]
        if count == 0:
            return
        flat = np.ascontiguousarray(rows, dtype=array.dtype).reshape(count, -1, rows.shape[-1])
        moved = [rt.to_device(x) for x in (flat, pages.astype(np.int64), slots.astype(np.int64))]
        rt.launch_map(_write_rows, int(flat.size), _flat(array), moved[1], moved[2], moved[0])

    def copy_page(self, array: Any, dst: int, src: int) -> None:
        pool = _flat(array)
        rt.launch_map(_copy_page, int(np.prod(tuple(pool.shape)[1:])), pool, np.int64(dst), np.int64(src))

    def host(self, array: Any) -> np.ndarray:
        return rt.copy_to_host(array)
