"""Copying a sequence's pages into the contiguous layout the attention kernels read."""

from __future__ import annotations

import numba
import numpy as np


@numba.njit(cache=True, nogil=True)
def gather_pages(pool: np.ndarray, pages: np.ndarray, rows: int, out: np.ndarray) -> None:
    """``out[h, r] = pool[pages[r // size], h, r % size]`` for the first ``rows`` rows.

    ``pool`` is ``[num_pages, heads, page_size, d]``, ``out`` ``[heads, >= rows, d]``.
    """
    heads, size, d = pool.shape[1], pool.shape[2], pool.shape[3]
    for h in range(heads):
        for p in range(pages.shape[0]):
            page = pages[p]
            for r in range(min(size, rows - p * size)):
                row = p * size + r
                for c in range(d):
                    out[h, row, c] = pool[page, h, r, c]
