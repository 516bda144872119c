"""The shared-memory warp instructions of ``warp_ptx.py`` under Numba's CUDA simulator: ``ldmatrix``,
``cp.async`` and 16-bit pair loads and stores, with the bank conflicts they would cost.

They go through their warp's exchange (``warp_sim.py``).  ``ldmatrix_x4`` (``.trans``) reads
the warp's 32 row addresses once and hands each lane its places of ``mma_atoms.LdMatrix``'s
fragment.  ``cp_async16`` reads its 16 source bytes at the call but writes them into shared memory
only at the issuing thread's ``cp_async_wait`` that completes its group (``cp_async_commit``), as
``cp.async`` does: shared memory read before the wait is stale, and another thread's copies are
seen only after its wait and a ``syncthreads``.  Both count the bank conflicts of their warp's
addresses (``bank_counts``).
"""

from __future__ import annotations

import threading
from collections import Counter

import numpy as np

from attncomp.backends.numba_cuda.mma.atoms import (
    BANK_BYTES,
    BANKS,
    CP_ASYNC_16,
    HALF_SHIFTS,
    LANES,
    LDMATRIX_X4,
    LDMATRIX_X4_TRANS,
    LdMatrix,
)
from attncomp.backends.numba_cuda.mma.warp_sim import emulated, exchange, warp_of

#: the instructions whose bank conflicts are counted; (instructions, conflicts) of each by name
_COUNTED = (LDMATRIX_X4.name, LDMATRIX_X4_TRANS.name, CP_ASYNC_16.name)
_COUNTS: dict[str, tuple[int, int]] = dict.fromkeys(_COUNTED, (0, 0))
_COUNTS_LOCK = threading.Lock()


def bank_counts() -> dict[str, tuple[int, int]]:
    """(warp instructions, bank conflicts) of ``ldmatrix`` (``LDMATRIX_X4.name``, ``LDMATRIX_X4_TRANS.name``)
    and ``cp.async`` (``CP_ASYNC_16.name``) since the last :func:`reset_bank_counts`.

    The model: ``ldmatrix`` is served one phase per matrix (its eight row addresses), ``cp.async``'s
    16-byte stores one phase per ``CP_ASYNC_16.lanes_per_phase`` consecutive lanes.  A 4-byte word
    at ``byte`` of its shared array lies in bank ``(byte // BANK_BYTES) % BANKS`` (an array taken to
    start at bank 0); a phase takes as many passes as the most distinct words that fall in one bank
    (one word read by several lanes is a broadcast), and costs ``passes - 1`` conflicts; an
    instruction's conflicts are the sum over its phases."""
    with _COUNTS_LOCK:
        return dict(_COUNTS)


def reset_bank_counts() -> None:
    """Start :func:`bank_counts` from zero."""
    with _COUNTS_LOCK:
        _COUNTS.update(dict.fromkeys(_COUNTED, (0, 0)))


def _count(name: str, phases: list[list[tuple[np.ndarray, int, int]]]) -> None:
    """Count one warp instruction and its conflicts; each phase a list of accesses (shared bytes,
    byte offset, bytes)."""
    conflicts = 0
    for phase in phases:
        words = set()
        for shared, byte, size in phase:
            base = shared.ctypes.data  # the same word however the array was viewed
            words.update((base, word) for word in range(byte // BANK_BYTES, (byte + size - 1) // BANK_BYTES + 1))
        if words:
            conflicts += max(Counter(word % BANKS for _, word in words).values()) - 1
    with _COUNTS_LOCK:
        instructions, total = _COUNTS[name]
        _COUNTS[name] = (instructions + 1, total + conflicts)


def _array(array) -> np.ndarray:
    """The numpy array of a shared array (numpy already) or of a kernel argument (the simulator's
    wrappers give their numpy array's interface: a view, so stores reach it)."""
    found = np.asarray(array)
    if found.dtype == object:
        raise TypeError(f"an array is needed, not {type(array).__name__}")
    if not found.flags.c_contiguous:  # a flat offset would not be the GPU's address
        raise TypeError(f"a C-contiguous array is needed, not one of shape {found.shape}, strides {found.strides}")
    return found


def _bytes(array: np.ndarray) -> np.ndarray:
    """The bytes of a C-contiguous array, flat: a view, so stores reach the array."""
    return array.reshape(-1).view(np.uint8)


def _source_bytes(array) -> np.ndarray:
    """The bytes from a copy source's first element on, flat, as the GPU's addresses see them: a
    C-contiguous array's, or one whose rows are a pitch apart (each row contiguous: a head's rows of
    ``[B, T, H, D]``), the memory between its rows included.  Read only."""
    found = np.asarray(array)
    if found.dtype == object:
        raise TypeError(f"an array is needed, not {type(array).__name__}")
    if found.flags.c_contiguous:
        return _bytes(found)
    rows_contiguous = found.ndim >= 1 and (found.shape[-1] == 1 or found.strides[-1] == found.itemsize)
    if not rows_contiguous or min(found.strides) < 0 or 0 in found.shape:
        raise TypeError(f"rows of contiguous elements are needed, not shape {found.shape}, strides {found.strides}")
    extent = sum((n - 1) * s for n, s in zip(found.shape, found.strides)) + found.itemsize
    flat = np.lib.stride_tricks.as_strided(found, shape=(extent // found.itemsize,), strides=(found.itemsize,))
    return flat.view(np.uint8)


def _checked(data: np.ndarray, byte: int, size: int, what: str) -> int:
    """``byte``, once it is 16-byte aligned (as the hardware needs) and its ``size`` bytes lie in ``data``."""
    if byte % 16 or not 0 <= byte <= data.size - size:
        raise IndexError(f"{what}: {size} bytes at byte {byte} of {data.size}, not 16-byte aligned or outside")
    return byte


def _ldmatrix_places(atom: LdMatrix) -> tuple[np.ndarray, np.ndarray]:
    """By lane, register and half: the row (as the lane that gives its address) and the column of
    the element it holds, from the atom's fragment and ``matrix_of``."""
    lane_of = {atom.matrix_of(lane): lane for lane in range(LANES)}
    rows = np.empty((LANES, atom.count, atom.fragment.per_register), np.intp)
    cols = np.empty_like(rows)
    for lane, matrix, half in np.ndindex(rows.shape):
        row, cols[lane, matrix, half] = atom.fragment.place(lane, 0, half)
        rows[lane, matrix, half] = lane_of[matrix, row]
    return rows, cols


_LDMATRIX_PLACES = {atom.name: _ldmatrix_places(atom) for atom in (LDMATRIX_X4, LDMATRIX_X4_TRANS)}
_SHIFTS = np.array(HALF_SHIFTS, np.uint32)


def _ldmatrix(atom: LdMatrix, addresses: list) -> np.ndarray:
    """Every lane's registers (by lane and matrix, uint32) from the warp's row addresses (shared
    bytes and byte offset, by lane); counts the instruction's bank conflicts, a phase a matrix."""
    if any(address is None for address in addresses):
        raise RuntimeError(f"{atom.name} needs the row addresses of all {LANES} lanes")
    matrices = [[lane for lane in range(LANES) if atom.matrix_of(lane)[0] == j] for j in range(atom.count)]
    _count(atom.name, [[(*addresses[lane], atom.row_bytes) for lane in lanes] for lanes in matrices])
    rows = np.stack([shared[byte : byte + atom.row_bytes] for shared, byte in addresses]).view(np.uint16)
    lanes, cols = _LDMATRIX_PLACES[atom.name]
    return np.bitwise_or.reduce(rows[lanes, cols].astype(np.uint32) << _SHIFTS, axis=-1)


def _ldmatrix_x4(addresses: list) -> np.ndarray:
    return _ldmatrix(LDMATRIX_X4, addresses)


def _ldmatrix_x4_trans(addresses: list) -> np.ndarray:
    return _ldmatrix(LDMATRIX_X4_TRANS, addresses)


def _load(combine, atom: LdMatrix, sh, byte) -> tuple:
    shared = _bytes(_array(sh))
    registers, lane = exchange((shared, _checked(shared, int(byte), atom.row_bytes, atom.name)), combine)
    r0, r1, r2, r3 = registers[lane]
    return r0, r1, r2, r3


@emulated
def ldmatrix_x4(sh, byte):
    """``ldmatrix.x4``: register ``j`` holds this lane's places of matrix ``j``, whose rows are at the
    bytes ``byte`` of ``sh`` that lanes ``8 j .. 8 j + 7`` give (``LDMATRIX_X4``)."""
    return _load(_ldmatrix_x4, LDMATRIX_X4, sh, byte)


@emulated
def ldmatrix_x4_trans(sh, byte):
    """``ldmatrix.x4.trans``: as :func:`ldmatrix_x4`, with ``LDMATRIX_X4_TRANS``'s places."""
    return _load(_ldmatrix_x4_trans, LDMATRIX_X4_TRANS, sh, byte)


def _cp_async16(stores: list) -> None:
    """Counts the bank conflicts of the warp's 16-byte stores (shared bytes and byte offset by lane,
    None where the warp has no such lane), a phase per ``lanes_per_phase`` consecutive lanes."""
    step, size = CP_ASYNC_16.lanes_per_phase, CP_ASYNC_16.bytes
    phases = [[(*store, size) for store in stores[p : p + step] if store is not None] for p in range(0, LANES, step)]
    _count(CP_ASYNC_16.name, phases)


@emulated
def cp_async16(dst, dst_byte, src, src_elem, src_bytes):
    """Copy ``src_bytes`` (0 to 16) bytes from element ``src_elem`` of ``src`` (flat) to byte ``dst_byte``
    of ``dst``, the rest of the 16 zero: read now, kept pending in this lane's current group.  With
    ``src_bytes`` 0 nothing is read, so ``src_elem`` may lie past the array (a row past its end)."""
    size = int(src_bytes)
    if not 0 <= size <= CP_ASYNC_16.bytes:
        raise ValueError(f"{CP_ASYNC_16.name}: src_size {size} is not in 0..{CP_ASYNC_16.bytes}")
    shared, source = _bytes(_array(dst)), _source_bytes(src)
    at = _checked(shared, int(dst_byte), CP_ASYNC_16.bytes, "cp.async destination")
    data = np.zeros(CP_ASYNC_16.bytes, np.uint8)  # read now (the source is input nobody writes), zero-filled
    if size:  # src_size 0 reads nothing (the instruction's ignore-src form): a row past the end's address
        read = _checked(source, int(src_elem) * np.asarray(src).itemsize, size, "cp.async source")
        data[:size] = source[read : read + size]
    exchange((shared, at), _cp_async16)
    warp, lane = warp_of(threading.current_thread())
    warp.copies[lane].append((shared, at, data))


@emulated
def cp_async_commit():
    """Close this thread's current group of pending copies (an empty group if none)."""
    warp, lane = warp_of(threading.current_thread())
    warp.groups[lane].append(warp.copies[lane])
    warp.copies[lane] = []


@emulated
def cp_async_wait(n):
    """Write into shared memory the copies of this thread's committed groups but the newest ``n``."""
    warp, lane = warp_of(threading.current_thread())
    groups = warp.groups[lane]
    done = max(len(groups) - int(n), 0)  # all but the newest n
    for group in groups[:done]:
        for shared, at, data in group:
            shared[at : at + data.size] = data
    del groups[:done]


def _pair(array, index) -> tuple[np.ndarray, int]:
    """The flat 16-bit patterns of a dense array and an even element index into them."""
    flat = _array(array).reshape(-1)
    at = int(index)
    if flat.itemsize != 2 or at % 2 or not 0 <= at < flat.size - 1:
        raise IndexError(f"a pair of 16-bit elements at {at} of {flat.size} ({flat.dtype})")
    return flat.view(np.uint16), at


@emulated
def load_pair16(array, index):
    bits, at = _pair(array, index)
    return np.uint32(int(bits[at]) | (int(bits[at + 1]) << 16))


@emulated
def store_pair16(array, index, word):
    bits, at = _pair(array, index)
    bits[at], bits[at + 1] = int(word) & 0xFFFF, (int(word) >> 16) & 0xFFFF


_RED_LOCK = threading.Lock()


@emulated
def red_add_f32(array, index, value):
    """``red.global.add.f32``: ``value`` added to element ``index`` of a dense float32 array (flat), one
    lane at a time."""
    whole = _array(array)
    flat = whole.reshape(-1)  # a view: the array is dense
    at = int(index)
    if not np.shares_memory(flat, whole) or flat.dtype != np.float32 or not 0 <= at < flat.size:
        raise IndexError(f"red.global.add.f32 at {at} of {flat.size} ({flat.dtype})")
    with _RED_LOCK:
        flat[at] += np.float32(value)
