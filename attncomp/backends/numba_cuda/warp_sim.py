"""The warp instructions of ``warp_ptx.py`` under Numba's CUDA simulator, with the same fragments.

The simulator runs a block's threads as Python threads (one block at a time) and cannot execute
PTX, nor shuffle registers between lanes.  An instruction that trades registers (``mma``, the
shuffles) goes through its warp's exchange: each lane leaves its registers there and waits at the
warp's barrier, whose parties are the warp's threads (32, or fewer in a partial last warp); the
last lane to arrive computes the instruction once for the whole warp (the 16 x 8 product of an
``mma``, every lane's value of a shuffle) and each lane takes its places of the result (lane ``l``
holds the same elements as on the GPU: the places of ``mma_atoms.py``'s table).  The block's
barrier (``cuda.syncthreads``) is never touched: warps run apart as on the GPU, so a kernel that
lacks a ``syncthreads`` between one warp's stores to shared memory and another warp's loads reads
memory nobody wrote here too.

A warp instruction needs every lane of its warp, as ``mma.sync`` and ``shfl.sync`` do on the GPU
(the kernels call these where every thread of the block does, never under a per-thread
condition); a lane that has exited, waits at ``cuda.syncthreads`` or is at another instruction
while its warp waits for it is an error here instead of a hang.

The shared-memory instructions go through the exchange too.  ``ldmatrix_x4`` (``.trans``) reads
the warp's 32 row addresses once and hands each lane its places of ``mma_atoms.LdMatrix``'s
fragment.  ``cp_async16`` reads its 16 source bytes at the call but writes them into shared memory
only at the issuing thread's ``cp_async_wait`` that completes its group (``cp_async_commit``), as
``cp.async`` does: shared memory read before the wait is stale, and another thread's copies are
seen only after its wait and a ``syncthreads``.  Both count the bank conflicts of their warp's
addresses (``bank_counts``).
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections import Counter

import ml_dtypes
import numpy as np
from numba import cuda

from attncomp.backends.numba_cuda.mma_atoms import (
    ACCUMULATOR,
    BANK_BYTES,
    BANKS,
    CP_ASYNC_16,
    HALF_SHIFTS,
    LANES,
    LDMATRIX_X4,
    LDMATRIX_X4_TRANS,
    M16N8K8_TF32,
    M16N8K16,
    Fragment,
    LdMatrix,
    MmaAtom,
)

_LANE = np.arange(LANES)
#: the XOR masks of a quad's butterfly (the lanes that share an accumulator row)
_QUAD = ACCUMULATOR.row_lane_masks()
#: seconds a waiting lane sleeps between looks at its block (aborted, or a lane that cannot come)
_PATIENCE = 0.25
#: looks in a row that find a lane at ``cuda.syncthreads`` before that is an error
_LOOKS = 4
#: creates a block's warps
_LOCK = threading.Lock()


def _device(function):
    """A device function as the simulator would run it, less the simulator's wrapper: that swaps
    the simulated ``cuda`` module into the function's globals around every call (two locks a
    call), and these functions never read ``cuda``."""
    return function


class _Warp:
    """A warp of the block being simulated: the registers its lanes trade, its barrier, and its
    lanes' pending ``cp.async`` copies (kept here, they end with their block and launch).

    The barrier is a lock that guards the count of lanes arrived and a gate per lane, held shut
    while the lane is not waiting: the last lane to arrive opens the waiting lanes' gates, and a
    lane leaves through its own gate (no lock that every lane of the warp takes again)."""

    def __init__(self, index: int, parties: int):
        self.index = index
        self.parties = parties  # the warp's threads
        self.lock = threading.Lock()
        self.gates = [threading.Lock() for _ in range(32)]
        for gate in self.gates:
            gate.acquire()
        self.values: list = [None] * 32  # by lane; None where the warp has no such lane
        self.arrived: list[int] = []  # the lanes at the instruction under way
        self.combine = None  # the instruction under way
        self.generation = 0  # instructions done
        self.result = None
        self.error: BaseException | None = None
        # by lane, touched by that lane's thread only: its cp.async copies not yet committed, and its
        # committed groups not yet waited for, oldest first (each copy: shared bytes, byte offset, data)
        self.copies: list[list[tuple]] = [[] for _ in range(32)]
        self.groups: list[list[list[tuple]]] = [[] for _ in range(32)]


@cuda.jit(device=True)
def _launch():
    """The simulator's ``cuda`` module of the launch under way: it stands in for ``cuda`` in a
    device function's globals while the function runs."""
    return cuda


#: the warps of the launches under way (the simulator's module of each launch), by block and index
_LAUNCHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _warp_of(thread: threading.Thread) -> tuple[_Warp, int]:
    """The warp of a simulator thread and its lane: warps are kept by launch and block (a fresh
    set for each block the simulator runs) and cached by the thread (a thread runs one block)."""
    found = getattr(thread, "_warp_sim_lane", None)
    if found is not None:
        return found
    launch = _launch()
    index, lane = divmod(thread.thread_id, 32)
    key = (*thread.blockIdx, index)
    with _LOCK:
        warps = _LAUNCHES.setdefault(launch, {})
        warp = warps.get(key)
        if warp is None:
            size = launch.blockDim
            warp = warps[key] = _Warp(index, min(32, size.x * size.y * size.z - 32 * index))
    thread._warp_sim_lane = warp, lane
    return warp, lane


def _exchange(value, combine):
    """``combine`` of every lane's ``value`` (a list by lane, None where the warp has no such lane),
    computed once by the last lane of the warp to arrive, and this thread's lane.

    A lane leaves only once every lane has arrived, and the last one to arrive starts the next
    instruction's count: one barrier serves instructions back to back.  The result stays until
    every lane has come to the next instruction, so a lane reads it after leaving the lock."""
    thread = threading.current_thread()
    warp, lane = _warp_of(thread)
    with warp.lock:
        if not warp.arrived:
            warp.combine = combine
        elif combine is not warp.combine:
            raise RuntimeError(
                f"lane {lane} of warp {warp.index} is at {combine.__name__}, its warp at {warp.combine.__name__}"
            )
        warp.values[lane] = value
        warp.arrived.append(lane)
        generation, last = warp.generation, len(warp.arrived) == warp.parties
        if last:
            try:
                warp.result, warp.error = combine(warp.values), None
            except Exception as error:  # every lane raises it
                warp.result, warp.error = None, error
            waiting, warp.arrived = warp.arrived[:-1], []
            warp.generation += 1
            for other in waiting:
                warp.gates[other].release()
    if not last:
        _wait(thread, warp, lane, generation)
    if warp.error is not None:
        raise warp.error
    return warp.result, lane


def _wait(thread, warp: _Warp, lane: int, generation: int) -> None:
    """Wait at this lane's gate until the last lane of the warp arrives at instruction
    ``generation``; look at the block now and then for a lane that cannot come."""
    gate, looks = warp.gates[lane], 0
    while not gate.acquire(timeout=_PATIENCE):
        with warp.lock:
            if warp.generation != generation:
                continue  # the gate is open: taken on the next try
            stuck = _look_at_block(thread, warp)
        looks = looks + 1 if stuck else 0
        if looks == _LOOKS:  # not a lane the simulator is just releasing
            raise RuntimeError(f"{stuck} at syncthreads while its warp waits at a warp instruction")


def _look_at_block(thread, warp: _Warp) -> str | None:
    """Raise when the block was aborted or a lane ``warp`` waits for has exited; name a lane that
    waits at ``cuda.syncthreads`` instead (it cannot come, unless the simulator is releasing it)."""
    if thread.abort:  # another thread raised: the simulator stops the block
        raise RuntimeError("abort flag set on a warp instruction")
    started = _block_threads(thread)
    for lane in sorted(set(range(warp.parties)) - set(warp.arrived)):
        other = started.get(32 * warp.index + lane)
        if other is None:  # not started yet
            continue
        if not other.is_alive():
            raise RuntimeError(f"lane {lane} of warp {warp.index} has exited before a warp instruction")
        if other.syncthreads_blocked:
            return f"lane {lane} of warp {warp.index} waits"
    return None


def _block_threads(thread) -> dict:
    """The threads the simulator has started for ``thread``'s block, by id (``BlockManager.run``
    keeps them)."""
    from numba.cuda.simulator.kernel import BlockManager

    run = BlockManager.run.__code__
    for frame in sys._current_frames().values():
        while frame is not None and frame.f_code is not run:
            frame = frame.f_back
        threads = list(frame.f_locals.get("threads", ())) if frame is not None else []
        if thread in threads:
            return {t.thread_id: t for t in threads}
    return {}


def _halves(words: np.ndarray, element: type) -> np.ndarray:
    """The 16-bit elements of 32-bit registers (half 0, then half 1: ``HALF_SHIFTS``), as float64,
    along a new last axis."""
    halves = [((words >> shift) & 0xFFFF).astype(np.uint16).view(element).astype(np.float64) for shift in HALF_SHIFTS]
    return np.stack(halves, axis=-1)


def _flat(fragment: Fragment) -> np.ndarray:
    """A fragment's places (``mma_atoms``) as indices into its matrix's flattened array: by lane,
    register and element of the register."""
    places = np.array(fragment.places())
    return places[..., 0] * fragment.cols + places[..., 1]


#: by lane, register and element: A's and B's places of m16n8k16 and of m16n8k8 (tf32); C's and D's
_A16, _B16 = _flat(M16N8K16.a), _flat(M16N8K16.b)
_A8, _B8 = _flat(M16N8K8_TF32.a), _flat(M16N8K8_TF32.b)
_C = _flat(ACCUMULATOR)[..., 0]
#: the registers of a lane the warp lacks: NaN as 16-bit, tf32 and float32 elements
_ABSENT = (0xFFFFFFFF,) * 6 + (np.nan,) * 4


def _fragments(rows: list) -> tuple[np.ndarray, np.ndarray]:
    """The warp's A and B registers (32 x 6, uint32) and C fragments (32 x 4, float64)."""
    rows = [_ABSENT if row is None else row for row in rows]
    return np.array([row[:6] for row in rows], np.uint32), np.array([row[6:] for row in rows], np.float64)


def _accumulate(d: np.ndarray, c: np.ndarray) -> np.ndarray:
    """Every lane's D fragment: its C fragment plus its places of the product ``d`` (16 x 8), float32."""
    return (c + d.ravel()[_C]).astype(np.float32)


def _product(x: np.ndarray, c: np.ndarray, a_places: np.ndarray, b_places: np.ndarray, atom: MmaAtom) -> np.ndarray:
    """Every lane's D fragment from the warp's A and B elements ``x`` (by lane, register, element)
    placed by the atom's table, and its C fragments ``c``."""
    a, b = np.empty(atom.m * atom.k), np.empty(atom.k * atom.n)
    a[a_places], b[b_places] = x[:, : atom.a.registers], x[:, atom.a.registers :]
    return _accumulate(a.reshape(atom.m, atom.k) @ b.reshape(atom.k, atom.n), c)


def _mma16(rows: list, element: type) -> np.ndarray:
    words, c = _fragments(rows)
    return _product(_halves(words, element), c, _A16, _B16, M16N8K16)


def _mma_f16(rows: list) -> np.ndarray:
    return _mma16(rows, np.float16)


def _mma_bf16(rows: list) -> np.ndarray:
    return _mma16(rows, ml_dtypes.bfloat16)


def _tf32(words: np.ndarray) -> np.ndarray:
    """tf32 registers as float64: the float32 their bits are, the low 13 ignored as the hardware does."""
    return (words & np.uint32(0xFFFFE000)).view(np.float32).astype(np.float64)


def _mma_tf32(rows: list) -> np.ndarray:
    words, c = _fragments(rows)
    return _product(_tf32(words)[..., None], c, _A8, _B8, M16N8K8_TF32)


def _mma(combine, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3) -> tuple:
    d, lane = _exchange((a0, a1, a2, a3, b0, b1, c0, c1, c2, c3), combine)
    d0, d1, d2, d3 = d[lane]
    return d0, d1, d2, d3


@_device
def mma_f16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    return _mma(_mma_f16, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)


@_device
def mma_bf16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    return _mma(_mma_bf16, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)


@_device
def mma_tf32(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    return _mma(_mma_tf32, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)


@_device
def f32_bits(x):
    return np.float32(x).view(np.uint32)


@_device
def bits_f32(bits):
    return np.uint32(bits).view(np.float32)


def _bits(value, element: type) -> int:
    return int(np.array(np.float32(value)).astype(element).view(np.uint16))


@_device
def pack_f16x2(lo, hi):
    return np.uint32(_bits(lo, np.float16) | (_bits(hi, np.float16) << 16))


@_device
def pack_bf16x2(lo, hi):
    return np.uint32(_bits(lo, ml_dtypes.bfloat16) | (_bits(hi, ml_dtypes.bfloat16) << 16))


@_device
def pack_halves(lo, hi):
    return np.uint32(int(np.float16(lo).view(np.uint16)) | (int(np.float16(hi).view(np.uint16)) << 16))


@_device
def pack_bits(lo, hi):
    return np.uint32((int(lo) & 0xFFFF) | ((int(hi) & 0xFFFF) << 16))


@_device
def widen_bf16(bits):
    return np.float32(np.array((int(bits) & 0xFFFF) << 16, dtype=np.uint32).view(np.float32))


@_device
def exp2_approx(x):
    return np.float32(np.exp2(np.float64(x)))


def _floats(values: list) -> np.ndarray:
    """The lanes' float32 values (NaN where the warp has no such lane)."""
    return np.array([np.nan if v is None else v for v in values], np.float32)


def _quad_max(values: list) -> np.ndarray:
    """Every lane's ``max(x, shfl(x, l ^ 1))``, then the same with ``l ^ 2`` (``_QUAD``): Python's
    ``max(a, b)`` (``b if b > a else a``) of float32, lane by lane."""
    x = _floats(values)
    for mask in _QUAD:
        x = np.where(x[_LANE ^ mask] > x, x[_LANE ^ mask], x)
    return x


def _quad_sum(values: list) -> np.ndarray:
    """Every lane's ``x + shfl(x, l ^ 1)``, then the same with ``l ^ 2`` (``_QUAD``), in float32."""
    x = _floats(values)
    for mask in _QUAD:
        x = x + x[_LANE ^ mask]
    return x


@_device
def shuffle_xor(x, mask):
    values, lane = _exchange(np.float32(x), _floats)
    return values[lane ^ mask]


@_device
def quad_max(x):
    values, lane = _exchange(np.float32(x), _quad_max)
    return values[lane]


@_device
def quad_sum(x):
    values, lane = _exchange(np.float32(x), _quad_sum)
    return values[lane]


@_device
def tf32_round(x):
    return np.uint32((f32_bits(np.float32(x)) + np.uint32(0x1000)) & np.uint32(0xFFFFE000))


@_device
def tf32_rest(x, big):
    return tf32_round(np.float32(x) - bits_f32(big))


@_device
def round_bf16(x):
    bits = f32_bits(np.float32(x))
    if (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):  # NaN: keep its top bits, set the quiet bit
        return np.uint16((bits >> np.uint32(16)) | np.uint32(0x40))
    # add just under half of the dropped unit, plus one when the kept part is odd: ties go to even
    return np.uint16((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))


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
    registers, lane = _exchange((shared, _checked(shared, int(byte), atom.row_bytes, atom.name)), combine)
    r0, r1, r2, r3 = registers[lane]
    return r0, r1, r2, r3


@_device
def ldmatrix_x4(sh, byte):
    """``ldmatrix.x4``: register ``j`` holds this lane's places of matrix ``j``, whose rows are at the
    bytes ``byte`` of ``sh`` that lanes ``8 j .. 8 j + 7`` give (``LDMATRIX_X4``)."""
    return _load(_ldmatrix_x4, LDMATRIX_X4, sh, byte)


@_device
def ldmatrix_x4_trans(sh, byte):
    """``ldmatrix.x4.trans``: as :func:`ldmatrix_x4`, with ``LDMATRIX_X4_TRANS``'s places."""
    return _load(_ldmatrix_x4_trans, LDMATRIX_X4_TRANS, sh, byte)


def _cp_async16(stores: list) -> None:
    """Counts the bank conflicts of the warp's 16-byte stores (shared bytes and byte offset by lane,
    None where the warp has no such lane), a phase per ``lanes_per_phase`` consecutive lanes."""
    step, size = CP_ASYNC_16.lanes_per_phase, CP_ASYNC_16.bytes
    phases = [[(*store, size) for store in stores[p : p + step] if store is not None] for p in range(0, LANES, step)]
    _count(CP_ASYNC_16.name, phases)


@_device
def cp_async16(dst, dst_byte, src, src_elem, src_bytes):
    """Copy ``src_bytes`` (0 to 16) bytes from element ``src_elem`` of ``src`` (flat) to byte ``dst_byte``
    of ``dst``, the rest of the 16 zero: read now, kept pending in this lane's current group."""
    size = int(src_bytes)
    if not 0 <= size <= CP_ASYNC_16.bytes:
        raise ValueError(f"{CP_ASYNC_16.name}: src_size {size} is not in 0..{CP_ASYNC_16.bytes}")
    shared, source = _bytes(_array(dst)), _array(src)
    at = _checked(shared, int(dst_byte), CP_ASYNC_16.bytes, "cp.async destination")
    read = _checked(_bytes(source), int(src_elem) * source.itemsize, size, "cp.async source")
    data = np.zeros(CP_ASYNC_16.bytes, np.uint8)  # read now (the source is input nobody writes), zero-filled
    data[:size] = _bytes(source)[read : read + size]
    _exchange((shared, at), _cp_async16)
    warp, lane = _warp_of(threading.current_thread())
    warp.copies[lane].append((shared, at, data))


@_device
def cp_async_commit():
    """Close this thread's current group of pending copies (an empty group if none)."""
    warp, lane = _warp_of(threading.current_thread())
    warp.groups[lane].append(warp.copies[lane])
    warp.copies[lane] = []


@_device
def cp_async_wait(n):
    """Write into shared memory the copies of this thread's committed groups but the newest ``n``."""
    warp, lane = _warp_of(threading.current_thread())
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


@_device
def load_pair16(array, index):
    bits, at = _pair(array, index)
    return np.uint32(int(bits[at]) | (int(bits[at + 1]) << 16))


@_device
def store_pair16(array, index, word):
    bits, at = _pair(array, index)
    bits[at], bits[at + 1] = int(word) & 0xFFFF, (int(word) >> 16) & 0xFFFF
