"""A paged decoder's pool in device memory: pages are written and copied by kernels, never moved.

``fn.paged_decoder`` on the cuda backend keeps each cached tensor as one
device array ``[num_pages, *heads, page_size, d]``; a step copies in only its
new tokens' keys and values (and, in one copy, the page tables and positions: ``staged``), and the attention kernels
read the pages in place (``ac.page_view``).  bf16 pages are kept as their
16-bit patterns (``arrays.Bf16Bits``) when the kernels that read them take
patterns (``CudaFunction.page_storage`` asks the function reading the pages):
the kernels below move 16-bit words then, and the attention widens each
element as it reads it.  Half the bytes of a float32 pool.  8-bit pages (``cache="f8e4m3"``,
``"f8e5m2"``) are kept as their codes' bytes (``arrays.CacheCodes``), their float32 scales
(``[num_pages, *heads, page_size]``) beside them; the pool quantises rows before they are written.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import cuda

from attncomp.backends.numba_cuda.host import arrays, launches
from attncomp.ir.types import CACHE_DTYPES, NUMPY_DTYPES

#: the 8-bit types pages may hold (kept as their codes' bytes)
CODES = {np.dtype(NUMPY_DTYPES[t]) for t in CACHE_DTYPES}


@cuda.jit(cache=True)
def _write_rows(pool, pages, slots, rows):
    """``pool[pages[c], h, slots[c], :] = rows[c, h, :]``; pool ``[num_pages, heads, size, d]``
    (float32, or uint16 bf16 patterns: the rows are of the pool's type)."""
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


#: the kernels above and the signatures a pool's launches give them (for the PTX tests), per element
SIGNATURES = {
    element: {
        _write_rows: f"void({element}[:, :, :, ::1], int64[::1], int64[::1], {element}[:, :, ::1])",
        _copy_page: f"void({element}[:, :, :, ::1], int64, int64)",
    }
    for element in ("float32", "uint16", "uint8")
}


def _flat(array: Any, one: bool = False) -> Any:
    """The pool as ``[num_pages, heads, size, d]`` (GQA and multi-axis heads flattened), no copy;
    ``one``: a pool of one element a row (scales ``[num_pages, *heads, size]``), d = 1."""
    shape = (*tuple(array.shape), 1) if one else tuple(array.shape)
    heads = int(np.prod(shape[1:-2], dtype=np.int64))
    return array.reshape(shape[0], heads, shape[-2], shape[-1])


class DevicePages:
    """Where a :class:`~attncomp.serving.pool.PagePool` keeps its pages on the cuda backend.

    ``bits``: bf16 pages are kept as 16-bit patterns (``arrays.Bf16Bits`` over uint16 device
    arrays), as the function reading them takes them; otherwise bf16 is widened to float32."""

    def __init__(self, bits: bool = False):
        self.bits = bits

    def zeros(self, shape: tuple[int, ...], dtype: Any) -> Any:
        if self.bits and np.dtype(dtype) == np.dtype(NUMPY_DTYPES["bf16"]):
            return arrays.Bf16Bits(arrays.zeros(tuple(shape), np.dtype(np.uint16)))
        if np.dtype(dtype) in CODES:  # 8-bit pages: their codes as bytes
            return arrays.CacheCodes(arrays.zeros(tuple(shape), np.dtype(np.uint8)), dtype)
        return arrays.zeros(tuple(shape), arrays.device_dtype(dtype))

    def write(self, array: Any, pages: np.ndarray, slots: np.ndarray, rows: np.ndarray) -> None:
        """Rows ``[count, *heads, d]`` (host) into their pages' slots: one copy in, one launch.  A
        16-bit pool takes the rows' bf16 patterns (rows of another float type rounded to bf16 first),
        an 8-bit one their codes' bytes; scales come as rows of one element (``[count, *heads, 1]``)
        into a pool of one a row (``[num_pages, *heads, size]``)."""
        count = rows.shape[0]
        if count == 0:
            return
        if isinstance(array, arrays.Bf16Bits):
            host = np.ascontiguousarray(rows, dtype=NUMPY_DTYPES["bf16"]).view(np.uint16)
        elif isinstance(array, arrays.CacheCodes):
            host = np.ascontiguousarray(rows, dtype=array.dtype).view(np.uint8)
        else:
            host = np.ascontiguousarray(rows, dtype=array.dtype)
        flat = host.reshape(count, -1, rows.shape[-1])
        pool = _flat(arrays.device_view(array), one=len(array.shape) == rows.ndim)
        if not arrays.is_device(pages):
            pages, slots = self.staged([pages, slots])
        launches.launch_map(_write_rows, int(flat.size), pool, pages, slots, arrays.to_device(flat))

    def staged(self, indices: list[np.ndarray]) -> list[Any]:
        """Integer host arrays (page tables, positions, key starts and counts, a write's pages and
        slots) on the device in one copy: int64 views of one buffer, each of its array's shape."""
        buffer = arrays.to_device(np.concatenate([np.ravel(x).astype(np.int64, copy=False) for x in indices]))
        views, at = [], 0
        for x in indices:
            view = arrays.sliced(buffer, slice(at, at + x.size))
            views.append(view if np.ndim(x) == 1 else view.reshape(np.shape(x)))
            at += x.size
        return views

    def copy_page(self, array: Any, dst: int, src: int) -> None:
        pool = _flat(arrays.device_view(array))
        launches.launch_map(_copy_page, int(np.prod(tuple(pool.shape)[1:])), pool, np.int64(dst), np.int64(src))

    def host(self, array: Any) -> np.ndarray:
        """The pages on the host (a 16-bit pool's as ``ml_dtypes.bfloat16``, an 8-bit one's as its type)."""
        host = arrays.copy_to_host(arrays.device_view(array))
        patterns = isinstance(array, (arrays.Bf16Bits, arrays.CacheCodes))
        return np.asarray(host).view(array.dtype) if patterns else host
