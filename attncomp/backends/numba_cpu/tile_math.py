"""The parts of the CPU kernels that no spec changes, compiled once and cached.

Generated kernels import these instead of carrying their own copies, so a new
spec compiles only what is its own (score, mask, loop bounds, tile loads);
these compile once per element type and machine (Numba's cache, beside this
file) and are linked into each kernel.

The online softmax keeps scores and maxima in base 2 (the score times
log2(e)), so its exponentials are ``2**x``.  In float32 that is a polynomial
LLVM vectorises (libm's ``expf`` is scalar); float64 uses ``np.exp2``.
"""

from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.extending import overload

from attncomp.backends.numba_cpu.intrinsics import bf16_to_f32, float_from_bits, prefer_wide_vectors

#: fast-math flags that keep infinities and NaN meaningful (masked scores are -inf)
FASTMATH = {"nsz", "arcp", "contract", "afn", "reassoc"}

#: a row keeps its max until a tile's exceeds it by more than this (base 2): weights stay below 2**8
LAZY = 8.0

# y = n + f with f in [0, 1); 2**f by a degree-6 fit (relative error 1e-7); 2**n from its
# exponent bits (n >= -126: a normal float).  Masked scores (-inf) weigh exactly nothing.
EXP_C = (
    1.0,
    0.6931468844413757,
    0.24023030698299408,
    0.05548214912414551,
    0.009679985232651234,
    0.0012437946861609817,
    0.0002168343198718503,
)


@njit(fastmath=FASTMATH, inline="always")
def exp2_f32(y):
    """2**y in float32 for y < 128; below -126 the result is 0."""
    # clamped by a conditional expression, a select (Numba's builtin ``max`` of two scalars is a
    # loop of its own inside the caller's); NaN passes through (the comparison is false)
    y_low = np.float32(-126.0) if y < np.float32(-126.0) else y
    n = np.floor(y_low)
    f = y_low - n
    p = np.float32(EXP_C[6])
    p = p * f + np.float32(EXP_C[5])
    p = p * f + np.float32(EXP_C[4])
    p = p * f + np.float32(EXP_C[3])
    p = p * f + np.float32(EXP_C[2])
    p = p * f + np.float32(EXP_C[1])
    p = p * f + np.float32(EXP_C[0])
    two_n = float_from_bits((np.int32(n) + np.int32(127)) << np.int32(23))
    return np.float32(0.0) if y < np.float32(-126.0) else p * two_n


@njit(fastmath=FASTMATH, inline="always")
def exp_nonpositive_f32(x):
    """exp(x) for x <= 0 (the backward's probabilities): 0 below -87, where float32 underflows."""
    return np.float32(0.0) if x < np.float32(-87.0) else exp2_f32(x * np.float32(1.4426950408889634))


def exp2(x):
    """2**x in the type of ``x`` (float32: :func:`exp2_f32`)."""
    raise NotImplementedError("exp2 is for compiled code")


@overload(exp2, fastmath=FASTMATH, inline="always")
def _exp2(x):
    if x == types.float32:
        return lambda x: exp2_f32(x)
    return lambda x: np.exp2(x)


# tanh x = x (1 + z (c3 + z (c5 + ...))), z = x * x: its Taylor series to x**13.  Below |x| = 1/2
# the first term left out (929569 x**15 / 638512875) is under 1e-7 of tanh x.
TANH_C = (-1 / 3, 2 / 15, -17 / 315, 62 / 2835, -1382 / 155925, 21844 / 6081075)


@njit(fastmath=FASTMATH, inline="always")
def tanh_f32(x):
    """tanh in float32 (soft-capped scores): the series below |x| = 1/2, ``1 - 2 / (e**(2|x|) + 1)``
    above (:func:`exp2_f32`; no cancellation there, as 2 / (e**(2|x|) + 1) < 0.54); both are
    computed and one selected, so LLVM vectorises it (libm's ``tanhf`` is scalar).  |x| is
    clamped at 10, where tanh rounds to 1; NaN stays NaN."""
    a = abs(x)
    a = np.float32(10.0) if a > np.float32(10.0) else a  # a select, as in exp2_f32
    z = a * a
    p = np.float32(TANH_C[5])
    p = p * z + np.float32(TANH_C[4])
    p = p * z + np.float32(TANH_C[3])
    p = p * z + np.float32(TANH_C[2])
    p = p * z + np.float32(TANH_C[1])
    p = p * z + np.float32(TANH_C[0])
    small = a + a * z * p
    e = exp2_f32(a * np.float32(2.8853900817779268))  # e**(2a) = 2**(2a log2 e)
    large = np.float32(1.0) - np.float32(2.0) / (e + np.float32(1.0))
    t = small if a < np.float32(0.5) else large
    t = t if x >= np.float32(0.0) else -t
    return x if x != x else t


def tanh(x):
    """tanh in the type of ``x`` (float32: :func:`tanh_f32`)."""
    raise NotImplementedError("tanh is for compiled code")


@overload(tanh, fastmath=FASTMATH)
def _tanh(x):
    if x == types.float32:
        return lambda x: tanh_f32(x)
    return lambda x: np.tanh(x)


# A few query rows (decoding) are matrix-vector work: plain loops on row-major scores beat a
# BLAS call's overhead.
@njit(fastmath=FASTMATH, cache=True, nogil=True)
def rows_scores(q, ks, s, nq, nk):  # s[:nq, :nk] = q[:nq] @ ks[:nk].T
    for r in range(nq):
        for c in range(nk):
            total = q.dtype.type(0.0)
            for d in range(q.shape[1]):
                total += q[r, d] * ks[c, d]
            s[r, c] = total


# The values' loops take four keys per pass over an accumulator row: its loads and stores,
# not the multiplies, bound the one-key loop (half the time, float32 and bf16 alike).
@njit(fastmath=FASTMATH, cache=True, nogil=True)
def rows_values(s, vs, acc, nq, nk):  # acc[:nq] += s[:nq, :nk] @ vs[:nk]
    for r in range(nq):
        c = 0
        while c + 4 <= nk:
            w0, w1, w2, w3 = s[r, c], s[r, c + 1], s[r, c + 2], s[r, c + 3]
            for e in range(acc.shape[1]):
                acc[r, e] += (w0 * vs[c, e] + w1 * vs[c + 1, e]) + (w2 * vs[c + 2, e] + w3 * vs[c + 3, e])
            c += 4
        for rest in range(c, nk):
            weight = s[r, rest]
            for e in range(acc.shape[1]):
                acc[r, e] += weight * vs[rest, e]


@njit(fastmath=FASTMATH, cache=True, nogil=True)
def rows_scores_bf16(q, ks, s, nq, nk):  # rows_scores of keys held as bf16 bits, widened as they are read
    for r in range(nq):
        for c in range(nk):
            total = q.dtype.type(0.0)
            for d in range(q.shape[1]):
                total += q[r, d] * bf16_to_f32(ks[c, d])
            s[r, c] = total


@njit(fastmath=FASTMATH, cache=True, nogil=True)
def rows_values_bf16(s, vs, acc, nq, nk):  # rows_values of values held as bf16 bits
    for r in range(nq):
        c = 0
        while c + 4 <= nk:
            w0, w1, w2, w3 = s[r, c], s[r, c + 1], s[r, c + 2], s[r, c + 3]
            for e in range(acc.shape[1]):
                pair = w0 * bf16_to_f32(vs[c, e]) + w1 * bf16_to_f32(vs[c + 1, e])
                acc[r, e] += pair + (w2 * bf16_to_f32(vs[c + 2, e]) + w3 * bf16_to_f32(vs[c + 3, e]))
            c += 4
        for rest in range(c, nk):
            weight = s[r, rest]
            for e in range(acc.shape[1]):
                acc[r, e] += weight * bf16_to_f32(vs[rest, e])


# The backward multiplies tiles with ``gemm`` (BLAS in place, accumulating).  OpenBLAS's small
# products are fast as q @ k and slow as q @ kᵀ, so each key/value tile is transposed once.
@njit(cache=True, nogil=True)
def transpose_into(src, dst, n):  # dst[:, :n] = src[:n].T
    for c in range(n):
        for e in range(src.shape[1]):
            dst[e, c] = src[c, e]


@njit(fastmath=FASTMATH, cache=True, nogil=True)
def reference_max(nq, m, total, acc, mx, m_safe, g):
    """Each row's reference max ``m_safe`` for a tile whose row maxima are ``mx``.

    A row keeps its max ``m[g, r]`` while the tile's exceeds it by at most ``LAZY`` (its
    weights stay below ``2**LAZY``, far from overflow); only when it grows more (or is
    NaN) are the max replaced and the row's weight sum ``total`` and accumulator
    rescaled -- after the first key blocks, rarely.
    """
    zero = m.dtype.type(0.0)
    lazy = m.dtype.type(LAZY)
    for r in range(nq):
        m_old = m[g, r]
        if mx[r] <= m_old + lazy:
            m_safe[r] = zero if m_old == -np.inf else m_old
        else:
            m_new = m_old if m_old > mx[r] else mx[r]
            m_safe[r] = zero if m_new == -np.inf else m_new
            alpha = exp2(m.dtype.type(m_old - m_safe[r]))
            m[g, r] = m_new
            total[g, r] *= alpha
            for e in range(acc.shape[2]):
                acc[g, r, e] *= alpha


@njit(fastmath=FASTMATH, cache=True, nogil=True)
def softmax_by_keys(st, nq, nk, m, total, acc, mx, m_safe, row_sum, g):
    """The online softmax step of a transposed score tile ``st[c, r]`` (scores in base 2,
    row maxima ``mx``): ``st`` becomes the weights P and each row's sum is added to
    ``total[g]`` (the softmax's ``l``), vectorised over the rows."""
    prefer_wide_vectors()
    reference_max(nq, m, total, acc, mx, m_safe, g)
    for r in range(nq):
        row_sum[r] = st.dtype.type(0.0)
    for c in range(nk):
        for r in range(nq):
            p = exp2(st.dtype.type(st[c, r] - m_safe[r]))
            st[c, r] = p
            row_sum[r] += p
    for r in range(nq):
        total[g, r] += row_sum[r]


@njit(fastmath=FASTMATH, cache=True, nogil=True)
def softmax_by_rows(sr, nq, nk, m, total, acc, mx, m_safe, g):
    """As :func:`softmax_by_keys` for a row-major tile ``sr[r, c]`` (a few query rows),
    each row vectorised over its keys."""
    prefer_wide_vectors()
    reference_max(nq, m, total, acc, mx, m_safe, g)
    for r in range(nq):
        m_row = m_safe[r]
        row_total = sr.dtype.type(0.0)
        for c in range(nk):
            p = exp2(sr.dtype.type(sr[r, c] - m_row))
            sr[r, c] = p
            row_total += p
        total[g, r] += row_total
