"""The warp instructions of ``warp_ptx.py`` under Numba's CUDA simulator, with the same fragments.

The simulator runs every thread as a Python thread and cannot execute PTX,
nor shuffle registers between lanes.  Each instruction here is a device
function that trades registers through shared memory: every lane writes
its fragment registers, the block synchronises, and each lane computes what
the hardware would leave in its registers (lane ``l`` holds the same
elements as on the GPU, ``warp.py``).  The exchange synchronises the whole
block, so the kernels call these only where every thread of the block
does (never under a per-thread condition), which holds on the GPU as well:
``mma.sync`` and ``shfl.sync`` need the whole warp.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
from numba import cuda

#: the most threads a block has (the exchange buffers hold one row each)
_THREADS = 1024
_LANE = np.arange(32)
_G, _T = _LANE >> 2, _LANE & 3


def _halves(words: np.ndarray, element: type) -> tuple[np.ndarray, np.ndarray]:
    """The low and high 16-bit elements of 32-bit registers, as float64."""
    lo = (words & 0xFFFF).astype(np.uint16).view(element).astype(np.float64)
    hi = (words >> 16).astype(np.uint16).view(element).astype(np.float64)
    return lo, hi


def _exchange(values: tuple) -> np.ndarray:
    """Every lane's ``values`` (32-bit registers), rows by lane, for this thread's warp."""
    ex = cuda.shared.array((_THREADS, 6), np.uint32)
    tid = cuda.threadIdx.x
    for k, value in enumerate(values):
        ex[tid, k] = np.uint32(value)
    cuda.syncthreads()
    base = tid - tid % 32
    words = np.array(ex[base : base + 32, : len(values)], dtype=np.uint32)
    cuda.syncthreads()  # the buffer is free for the next exchange
    return words


def _accumulate(d: np.ndarray, c: tuple) -> tuple:
    """This lane's C fragment plus its places of the warp's product ``d`` (16 x 8), as float32."""
    lane = cuda.threadIdx.x % 32
    g, t = lane >> 2, lane & 3
    places = ((g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1))
    return tuple(np.float32(np.float64(c[k]) + d[row, col]) for k, (row, col) in enumerate(places))


def _mma(element: type, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    words = _exchange((a0, a1, a2, a3, b0, b1))
    a = np.zeros((16, 16))
    b = np.zeros((16, 8))
    lo, hi = _halves(words, element)
    for reg, (row, col) in enumerate(((_G, 2 * _T), (_G + 8, 2 * _T), (_G, 2 * _T + 8), (_G + 8, 2 * _T + 8))):
        a[row, col], a[row, col + 1] = lo[:, reg], hi[:, reg]
    for reg, row in ((4, 2 * _T), (5, 2 * _T + 8)):
        b[row, _G], b[row + 1, _G] = lo[:, reg], hi[:, reg]
    return _accumulate(a @ b, (c0, c1, c2, c3))


@cuda.jit(device=True)
def mma_f16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    return _mma(np.float16, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)


@cuda.jit(device=True)
def mma_bf16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    return _mma(ml_dtypes.bfloat16, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)


def _tf32(words: np.ndarray) -> np.ndarray:
    """tf32 registers as float64: the float32 their bits are, the low 13 ignored as the hardware does."""
    return (words & np.uint32(0xFFFFE000)).view(np.float32).astype(np.float64)


@cuda.jit(device=True)
def mma_tf32(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    words = _exchange((a0, a1, a2, a3, b0, b1))
    a = np.zeros((16, 8))
    b = np.zeros((8, 8))
    x = _tf32(words)
    for reg, (row, col) in enumerate(((_G, _T), (_G + 8, _T), (_G, _T + 4), (_G + 8, _T + 4))):
        a[row, col] = x[:, reg]
    b[_T, _G], b[_T + 4, _G] = x[:, 4], x[:, 5]
    return _accumulate(a @ b, (c0, c1, c2, c3))


@cuda.jit(device=True)
def f32_bits(x):
    return np.uint32(np.array(np.float32(x)).view(np.uint32))


@cuda.jit(device=True)
def bits_f32(bits):
    return np.float32(np.array(np.uint32(bits)).view(np.float32))


def _bits(value, element: type) -> int:
    return int(np.array(np.float32(value)).astype(element).view(np.uint16))


@cuda.jit(device=True)
def pack_f16x2(lo, hi):
    return np.uint32(_bits(lo, np.float16) | (_bits(hi, np.float16) << 16))


@cuda.jit(device=True)
def pack_bf16x2(lo, hi):
    return np.uint32(_bits(lo, ml_dtypes.bfloat16) | (_bits(hi, ml_dtypes.bfloat16) << 16))


@cuda.jit(device=True)
def pack_halves(lo, hi):
    return np.uint32(int(np.float16(lo).view(np.uint16)) | (int(np.float16(hi).view(np.uint16)) << 16))


@cuda.jit(device=True)
def pack_bits(lo, hi):
    return np.uint32((int(lo) & 0xFFFF) | ((int(hi) & 0xFFFF) << 16))


@cuda.jit(device=True)
def widen_bf16(bits):
    return np.float32(np.array((int(bits) & 0xFFFF) << 16, dtype=np.uint32).view(np.float32))


@cuda.jit(device=True)
def exp2_approx(x):
    return np.float32(np.exp2(np.float64(x)))


def _partner(value, mask: int) -> np.float32:
    """The float32 ``value`` of lane ``lane ^ mask``."""
    ex = cuda.shared.array(_THREADS, np.float32)
    tid = cuda.threadIdx.x
    ex[tid] = value
    cuda.syncthreads()
    other = ex[tid ^ mask]
    cuda.syncthreads()
    return np.float32(other)


@cuda.jit(device=True)
def shuffle_xor(x, mask):
    return _partner(x, mask)


@cuda.jit(device=True)
def quad_max(x):
    x = max(np.float32(x), _partner(x, 1))
    return max(x, _partner(x, 2))


@cuda.jit(device=True)
def quad_sum(x):
    x = np.float32(np.float32(x) + _partner(x, 1))
    return np.float32(x + _partner(x, 2))


@cuda.jit(device=True)
def tf32_round(x):
    return np.uint32((f32_bits(np.float32(x)) + np.uint32(0x1000)) & np.uint32(0xFFFFE000))


@cuda.jit(device=True)
def tf32_rest(x, big):
    return tf32_round(np.float32(x) - bits_f32(big))


@cuda.jit(device=True)
def round_bf16(x):
    bits = f32_bits(np.float32(x))
    if (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):  # NaN: keep its top bits, set the quiet bit
        return np.uint16((bits >> np.uint32(16)) | np.uint32(0x40))
    # add just under half of the dropped unit, plus one when the kept part is odd: ties go to even
    return np.uint16((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
