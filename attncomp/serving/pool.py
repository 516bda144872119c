"""One pool of key/value pages shared by many sequences.

Each cached tensor (keys, values) is one array ``[num_pages, *heads,
page_size, d]``: a page holds ``page_size`` consecutive positions of one
sequence, each head's rows contiguous, as a kernel streams them (GQA pools
hold the key/value heads only).  A sequence is a page table and a length.  Pages are reference
counted: ``fork`` shares every page of the parent, and the partial last page
is copied only when one of its holders appends to it (copy on write), so a
fork copies at most one page; a page returns to the free list when its last
holder is freed.  The arrays live where the backend's kernels read them
(``storage``): host memory, or the GPU's for the cuda backend.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from attncomp.backends.host_pages import HostPages
from attncomp.ir.types import NUMPY_DTYPES
from attncomp.serving.pages import gather_pages


class PoolExhausted(ValueError):
    """A step needs more pages than are free; nothing was changed."""


@dataclass
class Sequence:
    pages: list[int] = field(default_factory=list)
    length: int = 0


class PagePool:
    def __init__(self, num_pages: int, page_size: int, storage: Any = None):
        if num_pages <= 0 or page_size <= 0:
            raise ValueError(f"num_pages and page_size must be positive, got {num_pages} and {page_size}")
        self.num_pages, self.page_size = int(num_pages), int(page_size)
        self.refs = np.zeros(self.num_pages, dtype=np.int64)
        self._free = list(range(self.num_pages - 1, -1, -1))  # pop() hands out page 0 first
        self.sequences: dict[int, Sequence] = {}
        self._ids = itertools.count()
        #: one ``[num_pages, *heads, page_size, d]`` array per cached tensor, made at the first append
        self.arrays: list[Any] | None = None
        #: where the pages live: host memory, or a backend's device (``backends.numba_cuda.host.pages``)
        self.storage = HostPages() if storage is None else storage

    @property
    def pages_free(self) -> int:
        return len(self._free)

    def sequence(self, seq: int) -> Sequence:
        try:
            return self.sequences[seq]
        except (KeyError, TypeError):
            raise KeyError(f"unknown or freed sequence {seq!r}") from None

    def new(self) -> int:
        seq = next(self._ids)
        self.sequences[seq] = Sequence()
        return seq

    def fork(self, seq: int) -> int:
        parent = self.sequence(seq)
        child = next(self._ids)
        self.sequences[child] = Sequence(list(parent.pages), parent.length)
        self.refs[parent.pages] += 1
        return child

    def free(self, seq: int) -> None:
        pages = self.sequence(seq).pages
        del self.sequences[seq]
        for page in pages:
            self.refs[page] -= 1
            if self.refs[page] == 0:
                self._free.append(page)

    def pages_needed(self, appends: dict[int, int]) -> int:
        """Pages that appending ``appends[seq]`` positions to each sequence takes, copies on write included."""
        size, needed, refs = self.page_size, 0, {}
        for seq, count in appends.items():
            s = self.sequence(seq)
            if count and s.length % size:  # the last page is partial: shared, it is copied first
                last = s.pages[-1]
                holders = refs.get(last, int(self.refs[last]))
                if holders > 1:
                    needed += 1
                    refs[last] = holders - 1
            needed += -(-(s.length + count) // size) - len(s.pages)
        return needed

    def allocate(self, shapes: list[tuple[tuple[int, ...], np.dtype]]) -> None:
        """Make the page arrays: one per cached tensor, whose positions are ``(*heads, d)`` of ``dtype``."""
        if self.arrays is None:
            self.arrays = [
                self.storage.zeros((self.num_pages, *rest[:-1], self.page_size, rest[-1]), dtype)
                for rest, dtype in shapes
            ]

    @property
    def bytes_per_position(self) -> int:
        """What one cached position takes, over every cached tensor."""
        sizes = (int(np.prod(tuple(a.shape)[1:], dtype=np.int64)) * a.dtype.itemsize for a in self.arrays or [])
        return sum(size // self.page_size for size in sizes)

    def host_arrays(self) -> list[np.ndarray]:
        """The page arrays in host memory (copies when the pool is on a device)."""
        return [self.storage.host(a) for a in self.arrays or []]

    def append(self, seq: int, rows: list[np.ndarray]) -> None:
        """Write ``rows[k]`` (``[count, *rest]``) after the cached positions of ``seq``, in place."""
        s, size = self.sequence(seq), self.page_size
        count = rows[0].shape[0]
        if count and s.length % size and self.refs[s.pages[-1]] > 1:
            old, page = s.pages[-1], self._free.pop()
            for array in self.arrays:
                self.storage.copy_page(array, page, old)
            self.refs[old] -= 1
            self.refs[page] = 1
            s.pages[-1] = page
        while len(s.pages) * size < s.length + count:
            page = self._free.pop()
            self.refs[page] = 1
            s.pages.append(page)
        positions = np.arange(s.length, s.length + count)
        pages = np.asarray(s.pages)[positions // size]
        for array, new in zip(self.arrays, rows):  # new: [count, *heads, d]
            self.storage.write(array, pages, positions % size, new)
        s.length += count

    def read(self, seq: int, start: int, stop: int) -> list[np.ndarray]:
        """Positions ``[start, stop)`` of ``seq`` in the spec's layout, ``[1, *heads, stop - start, d]``.

        One copy per cached tensor, page by page; ``start`` is a page boundary.  Rows past
        the sequence's last page are zeros (a ragged batch reads each entry to the longest).
        """
        s, size = self.sequence(seq), self.page_size
        first, last = start // size, -(-stop // size)
        pages = np.asarray(s.pages[first:last], dtype=np.int64)
        out = []
        for array in self.host_arrays():
            heads, d = array.shape[1:-2], array.shape[-1]
            buffer = np.zeros((1, *heads, stop - start, d), array.dtype)
            flat_heads = int(np.prod(heads, dtype=np.int64))
            raw = _gatherable(array)  # bf16 pages are gathered as their 16-bit patterns
            gather_pages(
                raw.reshape(self.num_pages, flat_heads, size, d),
                pages,
                stop - start,
                buffer.view(raw.dtype).reshape(flat_heads, stop - start, d),
            )
            out.append(buffer)
        return out


def _gatherable(array: np.ndarray) -> np.ndarray:
    """``array``, or the 16-bit patterns of a bf16 array (Numba has no bfloat16 element)."""
    return array.view(np.uint16) if array.dtype == np.dtype(NUMPY_DTYPES["bf16"]) else array
