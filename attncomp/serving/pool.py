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

An 8-bit pool (``cache="f8e4m3"`` or ``"f8e5m2"``) holds each cached tensor as
two arrays: its codes ``[num_pages, *heads, page_size, d]`` and beside them a
float32 scale per (token, head) row, ``[num_pages, *heads, page_size]`` (the
same page indexing); rows are quantised before they are appended
(``ir.quantized``), and pages are copied on write codes and scales alike.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from attncomp.backends.host_pages import HostPages
from attncomp.ir.quantized import dequantize
from attncomp.ir.types import NUMPY_DTYPES
from attncomp.serving.pages import gather_pages


class PoolExhausted(ValueError):
    """A step needs more pages than are free; nothing was changed."""


@dataclass
class Sequence:
    pages: list[int] = field(default_factory=list)
    length: int = 0


class Appended:
    """What an append changed, to take it back (:meth:`undo`): the sequences' page tables and lengths
    as they were, the pages it took from the free list, and the shared pages it copied on write.
    The rows it wrote lie past the restored lengths, in pages no sequence then holds or in a
    sequence's own last page: nothing reads them, and the next append writes over them."""

    def __init__(self, pool: PagePool):
        self.pool = pool
        self.sequences: list[tuple[Sequence, list[int], int]] = []
        self.taken: list[int] = []
        self.copied: list[int] = []

    def undo(self) -> None:
        pool = self.pool
        for s, pages, length in reversed(self.sequences):
            s.pages, s.length = pages, length
        pool.refs[self.taken] = 0
        for old in self.copied:
            pool.refs[old] += 1
        pool._free.extend(reversed(self.taken))  # handed out again in the order they were taken
        self.sequences, self.taken, self.copied = [], [], []


class PagePool:
    def __init__(self, num_pages: int, page_size: int, storage: Any = None, cache: str = ""):
        if num_pages <= 0 or page_size <= 0:
            raise ValueError(f"num_pages and page_size must be positive, got {num_pages} and {page_size}")
        #: the 8-bit type the pages hold ("" for the keys' own): each cached tensor is then codes and scales
        self.cache = cache
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
        """Make the page arrays: one per cached tensor, whose positions are ``(*heads, d)`` of ``dtype``;
        in an 8-bit pool, its codes and their scales."""
        if self.arrays is not None:
            return
        arrays = []
        for rest, dtype in shapes:
            rows = (self.num_pages, *rest[:-1], self.page_size)
            if self.cache:
                arrays += [self.storage.zeros((*rows, rest[-1]), NUMPY_DTYPES[self.cache])]
                arrays += [self.storage.zeros(rows, np.float32)]
            else:
                arrays += [self.storage.zeros((*rows, rest[-1]), dtype)]
        self.arrays = arrays

    def is_scales(self, k: int) -> bool:
        """Whether ``arrays[k]`` holds an 8-bit pool's scales (one per row) rather than rows."""
        return bool(self.cache) and k % 2 == 1

    @property
    def bytes_per_position(self) -> int:
        """What one cached position takes, over every cached tensor."""
        sizes = (int(np.prod(tuple(a.shape)[1:], dtype=np.int64)) * a.dtype.itemsize for a in self.arrays or [])
        return sum(size // self.page_size for size in sizes)

    def host_arrays(self) -> list[np.ndarray]:
        """The page arrays in host memory (copies when the pool is on a device)."""
        return [self.storage.host(a) for a in self.arrays or []]

    def append(self, seq: int, rows: list[np.ndarray]) -> Appended:
        """Write ``rows[k]`` (``[count, *rest]``) after the cached positions of ``seq``, in place: one
        per page array (an 8-bit pool's codes ``[count, *heads, d]`` and scales ``[count, *heads]``,
        quantised by the caller).  What it gives takes the append back (:class:`Appended`)."""
        return self.append_many({seq: rows})

    def append_many(self, appends: dict[int, list[np.ndarray]]) -> Appended:
        """:meth:`append` for several sequences at once: their pages taken (and copied on write) one
        sequence after another, then each page array written once for all of them (on the cuda
        backend, one copy in and one launch per array, whatever the number of sequences).

        Writing after every copy gives what appending one by one gives: a copy reads a page still
        shared, which no sequence of the step writes (a sequence writes a shared last page only
        after copying it, and the other holders write their own pages).  Every row is written past
        a sequence's length, in a page only that sequence holds: what :class:`Appended` gives back
        (lengths, page tables, pages taken) is all that took it in, and an append that fails takes
        itself back."""
        undo = Appended(self)
        try:
            self._append(appends, undo)
        except BaseException:  # a copy or a write that failed (a device's error): nothing taken in
            undo.undo()
            raise
        return undo

    def _append(self, appends: dict[int, list[np.ndarray]], undo: Appended) -> None:
        size = self.page_size
        pages_of, slots_of, rows_of = [], [], []
        for seq, rows in appends.items():
            s = self.sequence(seq)
            count = rows[0].shape[0]
            undo.sequences.append((s, list(s.pages), s.length))
            if count and s.length % size and self.refs[s.pages[-1]] > 1:
                old, page = s.pages[-1], self._free.pop()
                undo.taken.append(page)
                undo.copied.append(old)
                self.refs[old] -= 1
                self.refs[page] = 1
                s.pages[-1] = page
                for array in self.arrays:
                    self.storage.copy_page(array, page, old)
            while len(s.pages) * size < s.length + count:
                page = self._free.pop()
                undo.taken.append(page)
                self.refs[page] = 1
                s.pages.append(page)
            positions = np.arange(s.length, s.length + count)
            first = s.length // size  # the pages the rows go to: from the one holding the first
            pages_of.append(np.asarray(s.pages[first:])[positions // size - first])
            slots_of.append(positions % size)
            rows_of.append(rows)
            s.length += count
        if not rows_of:
            return
        pages, slots = self.storage.staged([np.concatenate(pages_of), np.concatenate(slots_of)])  # once for every array
        for k, array in enumerate(self.arrays):
            new = rows_of[0][k] if len(rows_of) == 1 else np.concatenate([rows[k] for rows in rows_of])
            if self.is_scales(k):  # [count, *heads]: written as rows of one element
                new = new[..., None]
            self.storage.write(array, pages, slots, new)  # new: [count, *heads, d]

    def read(self, seq: int, start: int, stop: int) -> list[np.ndarray]:
        """Positions ``[start, stop)`` of ``seq`` in the spec's layout, ``[1, *heads, stop - start, d]``.

        One copy per cached tensor, page by page; ``start`` is a page boundary.  Rows past
        the sequence's last page are zeros (a ragged batch reads each entry to the longest).
        An 8-bit pool's rows are read dequantised, in float32.
        """
        s, size = self.sequence(seq), self.page_size
        first, last = start // size, -(-stop // size)
        pages = np.asarray(s.pages[first:last], dtype=np.int64)
        out = []
        for k, array in enumerate(self.host_arrays()):
            if self.is_scales(k):
                array = array[..., None]
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
            out.append(buffer[..., 0] if self.is_scales(k) else buffer)
        if self.cache:
            return [dequantize(codes, scales) for codes, scales in zip(out[::2], out[1::2])]
        return out


def _gatherable(array: np.ndarray) -> np.ndarray:
    """``array``, or the bits of a bf16 or 8-bit array (Numba has no such element)."""
    if array.dtype == np.dtype(NUMPY_DTYPES["bf16"]):
        return array.view(np.uint16)
    return array.view(np.uint8) if array.dtype.itemsize == 1 else array
