"""A paged decoder's pool in host memory: the storage of the backends whose kernels read numpy arrays."""

from __future__ import annotations

from typing import Any

import numpy as np


class HostPages:
    """Pages in host memory (numpy arrays): the cpu and interp backends' pool."""

    def zeros(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        return np.zeros(shape, dtype)

    def write(self, array: np.ndarray, pages: np.ndarray, slots: np.ndarray, rows: np.ndarray) -> None:
        """``array[pages[c], ..., slots[c], :] = rows[c]`` for each new row ``c`` (rows of one element,
        ``[count, *heads, 1]``, into a pool of one a row: ``[num_pages, *heads, size]``)."""
        if array.ndim == rows.ndim:
            array = array[..., None]
        heads = (slice(None),) * (array.ndim - 3)
        array[(pages, *heads, slots)] = rows

    def staged(self, indices: list[np.ndarray]) -> list[np.ndarray]:
        """Integer arrays where the kernels read them: here, as they are."""
        return list(indices)

    def copy_page(self, array: np.ndarray, dst: int, src: int) -> None:
        array[dst] = array[src]

    def host(self, array: np.ndarray) -> np.ndarray:
        return array
