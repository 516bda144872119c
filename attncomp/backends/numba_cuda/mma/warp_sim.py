"""The warp instructions of ``mma/warp_ptx.py`` under Numba's CUDA simulator, with the same fragments.

The simulator runs a block's threads as Python threads (one block at a time) and cannot execute
PTX, nor shuffle registers between lanes.  An instruction that trades registers (``mma``, the
shuffles) goes through its warp's exchange: each lane leaves its registers there and waits at the
warp's barrier, whose parties are the warp's threads (32, or fewer in a partial last warp); the
last lane to arrive computes the instruction once for the whole warp (the 16 x 8 product of an
``mma``, every lane's value of a shuffle) and each lane takes its places of the result (lane ``l``
holds the same elements as on the GPU: the places of ``mma/atoms.py``'s table).  The block's
barrier (``cuda.syncthreads``) is never touched: warps run apart as on the GPU, so a kernel that
lacks a ``syncthreads`` between one warp's stores to shared memory and another warp's loads reads
memory nobody wrote here too.

A warp instruction needs every lane of its warp, as ``mma.sync`` and ``shfl.sync`` do on the GPU
(the kernels call these where every thread of the block does, never under a per-thread
condition); a lane that has exited, waits at ``cuda.syncthreads`` or is at another instruction
while its warp waits for it is an error here instead of a hang.

The shared-memory instructions (``ldmatrix``, ``cp.async``) are ``warp_sim_copies.py``'s.
"""

from __future__ import annotations

import sys
import threading
import weakref

import ml_dtypes
import numpy as np
from numba import cuda

from attncomp.backends.numba_cuda.mma.atoms import (
    ACCUMULATOR,
    HALF_SHIFTS,
    LANES,
    M16N8K8_TF32,
    M16N8K16,
    Fragment,
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


def emulated(function):
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


def warp_of(thread: threading.Thread) -> tuple[_Warp, int]:
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


def exchange(value, combine):
    """``combine`` of every lane's ``value`` (a list by lane, None where the warp has no such lane),
    computed once by the last lane of the warp to arrive, and this thread's lane.

    A lane leaves only once every lane has arrived, and the last one to arrive starts the next
    instruction's count: one barrier serves instructions back to back.  The result stays until
    every lane has come to the next instruction, so a lane reads it after leaving the lock."""
    thread = threading.current_thread()
    warp, lane = warp_of(thread)
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
            if other.exception:  # its own error, which the simulator may not have reported yet
                raise RuntimeError(f"lane {lane} of warp {warp.index} raised: {other.exception[0]}")
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
    d, lane = exchange((a0, a1, a2, a3, b0, b1, c0, c1, c2, c3), combine)
    d0, d1, d2, d3 = d[lane]
    return d0, d1, d2, d3


@emulated
def mma_f16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    return _mma(_mma_f16, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)


@emulated
def mma_bf16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    return _mma(_mma_bf16, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)


@emulated
def mma_tf32(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    return _mma(_mma_tf32, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)


@emulated
def f32_bits(x):
    return np.float32(x).view(np.uint32)


@emulated
def bits_f32(bits):
    return np.uint32(bits).view(np.float32)


def _bits(value, element: type) -> int:
    return int(np.array(np.float32(value)).astype(element).view(np.uint16))


@emulated
def pack_f16x2(lo, hi):
    return np.uint32(_bits(lo, np.float16) | (_bits(hi, np.float16) << 16))


@emulated
def pack_bf16x2(lo, hi):
    return np.uint32(_bits(lo, ml_dtypes.bfloat16) | (_bits(hi, ml_dtypes.bfloat16) << 16))


@emulated
def pack_halves(lo, hi):
    return np.uint32(int(np.float16(lo).view(np.uint16)) | (int(np.float16(hi).view(np.uint16)) << 16))


@emulated
def pack_bits(lo, hi):
    return np.uint32((int(lo) & 0xFFFF) | ((int(hi) & 0xFFFF) << 16))


@emulated
def widen_bf16(bits):
    return np.float32(np.array((int(bits) & 0xFFFF) << 16, dtype=np.uint32).view(np.float32))


@emulated
def exp2_approx(x):
    with np.errstate(over="ignore"):
        return np.float32(np.exp2(np.float64(x)))


@emulated
def log2_approx(x):
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.float32(np.log2(np.float64(x)))


@emulated
def rcp_approx(x):
    return np.float32(1.0 / np.float64(x)) if x != 0 else np.float32(np.copysign(np.inf, x))


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


@emulated
def shuffle_xor(x, mask):
    values, lane = exchange(np.float32(x), _floats)
    return values[lane ^ mask]


@emulated
def quad_max(x):
    values, lane = exchange(np.float32(x), _quad_max)
    return values[lane]


@emulated
def quad_sum(x):
    values, lane = exchange(np.float32(x), _quad_sum)
    return values[lane]


@emulated
def tf32_round(x):
    return np.uint32((f32_bits(np.float32(x)) + np.uint32(0x1000)) & np.uint32(0xFFFFE000))


@emulated
def tf32_rest(x, big):
    return tf32_round(np.float32(x) - bits_f32(big))


@emulated
def round_bf16(x):
    bits = f32_bits(np.float32(x))
    if (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):  # NaN: keep its top bits, set the quiet bit
        return np.uint16((bits >> np.uint32(16)) | np.uint32(0x40))
    # add just under half of the dropped unit, plus one when the kept part is odd: ties go to even
    return np.uint16((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
