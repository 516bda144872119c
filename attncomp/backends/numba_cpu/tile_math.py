"""The parts of the CPU kernels that no spec changes, compiled once and cached.

Generated kernels import these instead of carrying their own copies, so a new
spec compiles only what is its own (score, mask, loop bounds, tile loads);
these compile once per element type and machine (Numba's cache, beside this
file, keyed by attncomp's code: ``cache.stamp_helpers_by_runtime``) and are
linked into each kernel.  A decode step's grouped rows run on the explicit
vector loops of ``vector_loops.py`` (and ``code_loops.py`` for 8-bit caches).

A call from one compiled function to another increments and decrements the
reference count of each array it passes, and of each view the callee makes
(atomic operations).  A decode step makes several such calls per key tile and
head, so the overloads ``group_scores`` and ``group_values`` choose their loops
by are inlined into them, ``reference_max`` into its callers, and the grouped
loops address rows by number rather than through views: a GQA 32/8 bf16 step
over 16384 positions took about a sixth less time on one core.

The online softmax keeps scores and maxima in base 2 (the score times
log2(e)), so its exponentials are ``2**x``.  In float32 that is a polynomial
LLVM vectorises (libm's ``expf`` is scalar); float64 uses ``np.exp2``.
"""

from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.extending import overload

from attncomp.backends.numba_cpu.code_loops import HAS_CODE_TABLES, bf16_code_axpy4, bf16_code_dots4
from attncomp.backends.numba_cpu.intrinsics import bf16_to_f32, float_from_bits, prefer_wide_vectors
from attncomp.backends.numba_cpu.vector_loops import (
    CODES,
    HAS_BF16_DOT,
    KEYS,
    WIDTH,
    axpy4,
    code_dots4,
    code_to_f32,
    dots4,
    f32_bits,
    prefetch_row,
)
from attncomp.ir.ops import random as counters

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


# A call, not inlined by Numba (``inline="always"`` copies a callee's IR into every call site
# while the caller compiles, 5% of compiling four specs' kernel modules): LLVM inlines it, no call
# to it is left in a kernel's machine code
@njit(fastmath=FASTMATH)
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


@njit(fastmath=FASTMATH, inline="always")
def exp_f32(x):
    """e**x in float32 (``ac.exp`` in a score function): ``2**(x log2 e)`` by :func:`exp2_f32`, which
    LLVM vectorises (libm's ``expf`` is scalar); infinite from x = 88.73 on, 0 below -87.4."""
    y = x * np.float32(1.4426950408889634)
    return np.float32(np.inf) if y >= np.float32(128.0) else exp2_f32(y)


# log m for m in [sqrt(1/2), sqrt(2)): 2 atanh(s), s = (m - 1) / (m + 1), |s| < 0.172, by its series
# to s**9 (the next term, 2 s**11 / 11, is under 4e-10 of log m)
LOG_C = (2.0, 2 / 3, 2 / 5, 2 / 7, 2 / 9)


@njit(fastmath=FASTMATH, inline="always")
def log_f32(x):
    """The natural logarithm in float32 (``ac.log`` in a score function): x = m 2**e from its bits,
    m in [sqrt(1/2), sqrt(2)), ``e ln 2 + log m`` by :data:`LOG_C`; every branch a select, so LLVM
    vectorises it (libm's ``logf`` is scalar).  Subnormals are scaled by 2**23 first; log 0 is
    -inf, log of a negative NaN, log inf inf, NaN stays NaN."""
    tiny = x < np.float32(1.1754943508222875e-38)
    scaled = x * np.float32(8388608.0) if tiny else x
    bits = np.int32(f32_bits(scaled))
    e = ((bits >> np.int32(23)) & np.int32(255)) - np.int32(127)
    m = float_from_bits((bits & np.int32(0x7FFFFF)) | np.int32(0x3F800000))
    high = m > np.float32(1.4142135623730951)
    m = m * np.float32(0.5) if high else m
    e = e + np.int32(1) if high else e
    s = (m - np.float32(1.0)) / (m + np.float32(1.0))
    z = s * s
    p = np.float32(LOG_C[4])
    p = p * z + np.float32(LOG_C[3])
    p = p * z + np.float32(LOG_C[2])
    p = p * z + np.float32(LOG_C[1])
    p = p * z + np.float32(LOG_C[0])
    n = np.float32(e) - (np.float32(23.0) if tiny else np.float32(0.0))
    y = n * np.float32(0.6931471805599453) + s * p
    y = np.float32(-np.inf) if x == np.float32(0.0) else y
    y = np.float32(np.nan) if x < np.float32(0.0) else y
    return x if (x != x or x == np.float32(np.inf)) else y


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


#: ``ac.random``'s hash (``attncomp/ir/ops/random.py``), compiled into the kernels that draw dropout's mask
random_step = njit(inline="always")(counters.step)
random_unit = njit(inline="always")(counters.unit)


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


# A few query rows (decoding) are matrix-vector work: loops on row-major scores beat a BLAS
# call's overhead.  The query heads of a group (grouped-query attention) read one key/value
# tile: multiplying four of their rows in one pass over it reads (and, for bf16, widens) each
# element once per four rows instead of once per row.
def as_float(x):
    """An element of a key or value tile as a float: bf16 bits (uint16) widened, 8-bit codes
    (``f8e4m3`` as uint8, ``f8e5m2`` as int8) decoded without their row's scale (and divided by
    ``vector_loops.code_scale``), floats as they are."""
    raise NotImplementedError("as_float is for compiled code")


@overload(as_float, inline="always")
def _as_float(x):
    if x == types.uint16:
        return lambda x: bf16_to_f32(x)
    if x in CODES:
        return lambda x: code_to_f32(x)
    return lambda x: x


# An 8-bit cache's row is its codes times the row's scale (``ir.quantized``).  The few-row loops
# multiply the codes as they are decoded (their values over ``factor``, ``vector_loops.code_scale``)
# and apply each key's scale times ``factor`` to its score, and each value row's to its weight, once
# per key rather than once per element.  ``scale * factor`` is finite: a scale is at most a float32
# over 448, and ``factor`` at most 256.
@njit(fastmath=FASTMATH, cache=True, nogil=True)
def dequantize_rows(codes, scales, factor, out, n):
    """``out[c] = codes[c] * scales[c]`` for rows ``c < n``: an 8-bit tile's rows as floats."""
    for c in range(n):
        scale = out.dtype.type(scales[c] * factor)
        for e in range(codes.shape[1]):
            out[c, e] = as_float(codes[c, e]) * scale


@njit(fastmath=FASTMATH, cache=True, nogil=True)
def scale_keys(sg, scales, factor, n_heads, nq, nk, at):
    """``sg[g, r, at + c] *= scales[c] * factor`` for heads ``g < n_heads``, rows ``r < nq``, keys
    ``c < nk``: a group's products with decoded 8-bit codes made products with the rows they stand for."""
    for g in range(n_heads):
        for r in range(nq):
            s = sg[g, r, at:]
            for c in range(nk):
                s[c] *= scales[c] * factor


@njit(inline="always")
def row(x, k, nq):  # row k of a group's rows (head k // nq, query row k % nq)
    return x[k // nq, k % nq]


def bf16_query_rows(qt, qb, n_heads, nq):
    """The group's query rows ``qt`` as bf16 bits in ``qb`` (``qb[k]`` = row ``k``; rows past them to
    a multiple of four zeroed), for :func:`group_scores`' bf16 dot products.  Returns whether these
    give the float32 loops' products: query rows that are bf16 values (exactly: their float32 bits
    end in 16 zeros), at least two rows, of a multiple of 32, and the CPU's instruction.  Called once
    per task, not per key tile."""
    raise NotImplementedError("bf16_query_rows is for compiled code")


@overload(bf16_query_rows, fastmath=FASTMATH)
def _bf16_query_rows(qt, qb, n_heads, nq):
    if not (HAS_BF16_DOT and qt.dtype == types.float32):
        return lambda qt, qb, n_heads, nq: False

    def impl(qt, qb, n_heads, nq):
        n_rows = n_heads * nq
        n_d = qt.shape[2]
        if n_rows < 2 or n_d % WIDTH != 0 or qb.shape[0] < -(-n_rows // 4) * 4 or qb.shape[1] != n_d:
            return False
        qb[n_rows:] = 0  # rows past n_rows: their sums go to ``spare``
        low = np.uint32(0)  # the low bits of every query element: zero when all are bf16 values
        for k in range(n_rows):
            q = row(qt, k, nq)
            for d in range(n_d):
                bits = f32_bits(q[d])
                low |= bits
                qb[k, d] = np.uint16(bits >> np.uint32(16))
        return not (low & np.uint32(0xFFFF))  # else not bf16 values: the float32 loops keep their precision

    return impl


@njit(cache=True, nogil=True)
def query_bits(qt, qb, n_heads, nq):
    """:func:`bf16_query_rows`, compiled once."""
    return bf16_query_rows(qt, qb, n_heads, nq)


def bf16_group_scores(qb, ks, sg, spare, n_heads, nq, nk, ahead, at):
    """:func:`group_scores` on the CPU's bf16 dot products (``vector_loops.dots4``), from the query rows
    :func:`bf16_query_rows` wrote to ``qb``; rows past ``n_heads * nq`` to a multiple of four go to
    ``spare``; ``at`` as in :func:`group_scores`.  Returns whether it computed them: bf16 keys, or
    8-bit codes on a CPU with byte tables (``code_loops.bf16_code_dots4``: their values over
    ``code_scale``), contiguous within a row."""
    raise NotImplementedError("bf16_group_scores is for compiled code")


@overload(bf16_group_scores, fastmath=FASTMATH, inline="always")
def _bf16_group_scores(qb, ks, sg, spare, n_heads, nq, nk, ahead, at):
    if not (HAS_BF16_DOT and ks.dtype == types.uint16 or HAS_CODE_TABLES and ks.dtype in CODES):
        return lambda qb, ks, sg, spare, n_heads, nq, nk, ahead, at: False
    dots = dots4 if ks.dtype == types.uint16 else bf16_code_dots4

    def impl(qb, ks, sg, spare, n_heads, nq, nk, ahead, at):
        n_rows = n_heads * nq
        n_d = ks.shape[1]
        if ks.strides[1] != ks.itemsize or qb.shape[1] != n_d or qb.shape[0] < -(-n_rows // 4) * 4:
            return False
        full = nk - nk % KEYS  # keys in whole calls of dots4
        # the rows' scores written by index, not through views (each view costs reference counts);
        # the products of rows past the group's (to a multiple of four) go to ``spare``
        for k in range(0, n_rows, 4):
            g0, r0 = k // nq, k % nq
            g1, r1 = (k + 1) // nq, (k + 1) % nq
            g2, r2 = (k + 2) // nq, (k + 2) % nq
            g3, r3 = (k + 3) // nq, (k + 3) % nq
            whole = k + 4 <= n_rows
            for c in range(0, full, KEYS):
                t = dots(qb, k, ks, c, ahead)
                a = at + c
                sg[g0, r0, a], sg[g0, r0, a + 1], sg[g0, r0, a + 2], sg[g0, r0, a + 3] = t[0], t[1], t[2], t[3]
                if whole:
                    sg[g1, r1, a], sg[g1, r1, a + 1], sg[g1, r1, a + 2], sg[g1, r1, a + 3] = t[4], t[5], t[6], t[7]
                    sg[g2, r2, a], sg[g2, r2, a + 1], sg[g2, r2, a + 2], sg[g2, r2, a + 3] = t[8], t[9], t[10], t[11]
                    sg[g3, r3, a], sg[g3, r3, a + 1] = t[12], t[13]
                    sg[g3, r3, a + 2], sg[g3, r3, a + 3] = t[14], t[15]
                else:
                    for i in range(1, 4):
                        for j in range(KEYS):
                            value = t[KEYS * i + j]
                            if k + i < n_rows:
                                sg[(k + i) // nq, (k + i) % nq, a + j] = value
                            else:
                                spare[c + j] = value
        for last in range(full, nk):  # the last keys, fewer than KEYS
            for k in range(n_rows):
                total = np.float32(0.0)
                for d in range(n_d):
                    total += bf16_to_f32(qb[k, d]) * as_float(ks[last, d])
                sg[k // nq, k % nq, at + last] = total
        return True

    return impl


def code_group_scores(qt, ks, sg, spare, n_heads, nq, nk, ahead, at):
    """:func:`group_scores` over 8-bit codes on ``vector_loops.code_dots4`` (four rows with four keys
    at a time, the codes decoded once per four rows), their values over ``code_scale``; rows past
    ``n_heads * nq`` to a multiple of four go to ``spare``.  Returns whether it computed them: codes
    contiguous within rows of a multiple of 16."""
    raise NotImplementedError("code_group_scores is for compiled code")


@overload(code_group_scores, fastmath=FASTMATH, inline="always")
def _code_group_scores(qt, ks, sg, spare, n_heads, nq, nk, ahead, at):
    if not (ks.dtype in CODES and qt.dtype == types.float32):
        return lambda qt, ks, sg, spare, n_heads, nq, nk, ahead, at: False

    def impl(qt, ks, sg, spare, n_heads, nq, nk, ahead, at):
        n_rows = n_heads * nq
        n_d = ks.shape[1]
        if n_d % 16 != 0 or ks.strides[1] != 1 or qt.strides[2] != 4:
            return False
        full = nk - nk % KEYS  # keys in whole calls of code_dots4
        for k in range(0, n_rows, 4):
            q0 = row(qt, k, nq)
            s0 = row(sg, k, nq)[at:]
            q1, q2, q3, s1, s2, s3 = q0, q0, q0, spare, spare, spare
            if k + 1 < n_rows:
                q1, s1 = row(qt, k + 1, nq), row(sg, k + 1, nq)[at:]
            if k + 2 < n_rows:
                q2, s2 = row(qt, k + 2, nq), row(sg, k + 2, nq)[at:]
            if k + 3 < n_rows:
                q3, s3 = row(qt, k + 3, nq), row(sg, k + 3, nq)[at:]
            for c in range(0, full, KEYS):
                t = code_dots4(q0, q1, q2, q3, ks, c, ahead)
                s0[c], s0[c + 1], s0[c + 2], s0[c + 3] = t[0], t[1], t[2], t[3]
                s1[c], s1[c + 1], s1[c + 2], s1[c + 3] = t[4], t[5], t[6], t[7]
                s2[c], s2[c + 1], s2[c + 2], s2[c + 3] = t[8], t[9], t[10], t[11]
                s3[c], s3[c + 1], s3[c + 2], s3[c + 3] = t[12], t[13], t[14], t[15]
        for last in range(full, nk):  # the last keys, fewer than KEYS
            for k in range(n_rows):
                q, s = row(qt, k, nq), row(sg, k, nq)[at:]
                total = np.float32(0.0)
                for d in range(n_d):
                    total += q[d] * as_float(ks[last, d])
                s[last] = total
        return True

    return impl


@njit(fastmath=FASTMATH, cache=True, nogil=True)
def group_scores(qt, qb, q_bits, ks, sg, spare, n_heads, nq, nk, ahead, at):
    """``sg[g, r, at:at + nk] = qt[g, r] @ ks[:nk].T`` for heads ``g < n_heads`` and rows ``r < nq``
    (keys in float, or bf16 bits widened as read): four rows per pass over the keys.  With
    ``q_bits`` (:func:`query_bits` said yes, and wrote ``qb``) on the CPU's bf16 dot products
    (:func:`bf16_group_scores`, ``spare`` a row of ``nk``).  ``at``: the tile's key index of
    ``ks``' first row (a page's run of a tile's rows; 0 for a whole tile): ``sg`` stays whole and
    C-contiguous (a view from ``at`` on would make every loop over it strided).  The rows
    ``ahead`` on in ``ks`` are prefetched: the next tile's, where ``ks`` is a view of a cache
    (``ahead = nk``); 0 where the next rows are on another page."""
    if q_bits and bf16_group_scores(qb, ks, sg, spare, n_heads, nq, nk, ahead, at):
        return
    if code_group_scores(qt, ks, sg, spare, n_heads, nq, nk, ahead, at):
        return
    n_rows = n_heads * nq
    k = 0
    while k + 4 <= n_rows:
        q0, q1, q2, q3 = row(qt, k, nq), row(qt, k + 1, nq), row(qt, k + 2, nq), row(qt, k + 3, nq)
        s0, s1 = row(sg, k, nq)[at:], row(sg, k + 1, nq)[at:]
        s2, s3 = row(sg, k + 2, nq)[at:], row(sg, k + 3, nq)[at:]
        for c in range(nk):
            prefetch_row(ks, c + ahead)
            t0 = t1 = t2 = t3 = s0.dtype.type(0.0)
            for d in range(ks.shape[1]):
                x = as_float(ks[c, d])
                t0 += q0[d] * x
                t1 += q1[d] * x
                t2 += q2[d] * x
                t3 += q3[d] * x
            s0[c], s1[c], s2[c], s3[c] = t0, t1, t2, t3
        k += 4
    for rest in range(k, n_rows):
        q, s = row(qt, rest, nq), row(sg, rest, nq)[at:]
        for c in range(nk):
            total = s.dtype.type(0.0)
            for d in range(ks.shape[1]):
                total += q[d] * as_float(ks[c, d])
            s[c] = total


@njit(cache=True, nogil=True)
def prefetch_rows(rows):
    """Prefetch every row of a 2-d array (rows contiguous): a page's rows, while the run before
    them is multiplied."""
    for r in range(rows.shape[0]):
        prefetch_row(rows, r)


def vector_group_values(sg, vs, acc, rows, n_rows, nq, nk, ahead, at, bf16_weights):
    """``group_values``' fours of ``rows`` on :func:`vector_loops.axpy4` where it applies: float32
    accumulator rows of a multiple of 32, contiguous, and value rows of float32, bf16 bits or 8-bit
    codes, contiguous.  8-bit codes with ``bf16_weights``, on a CPU with byte tables, run on
    :func:`code_loops.bf16_code_axpy4` (weights rounded to bf16).  Returns how many of the rows it
    did (a multiple of four; none where it does not apply)."""
    raise NotImplementedError("vector_group_values is for compiled code")


@overload(vector_group_values, fastmath=FASTMATH, inline="always")
def _vector_group_values(sg, vs, acc, rows, n_rows, nq, nk, ahead, at, bf16_weights):
    if not (
        vs.dtype in (types.uint16, types.float32, *CODES) and acc.dtype == types.float32 and sg.dtype == types.float32
    ):
        return lambda sg, vs, acc, rows, n_rows, nq, nk, ahead, at, bf16_weights: 0
    on_tables = HAS_CODE_TABLES and vs.dtype in CODES

    def impl(sg, vs, acc, rows, n_rows, nq, nk, ahead, at, bf16_weights):
        if acc.shape[2] % WIDTH != 0 or acc.strides[2] != 4 or vs.strides[1] != vs.itemsize:
            return 0
        paired = on_tables and bf16_weights and sg.strides[2] == 4
        k = 0
        while k + 4 <= n_rows:  # the rows by number, not through views (a view costs reference counts)
            i0, i1, i2, i3 = rows[k], rows[k + 1], rows[k + 2], rows[k + 3]
            if paired:  # pairs of value rows on the bf16 dot products; an odd last row here
                bf16_code_axpy4(sg, acc, i0, i1, i2, i3, nq, at, vs, nk, ahead)
                if nk % 2:
                    last = nk - 1
                    for i in (i0, i1, i2, i3):
                        g, r = i // nq, i % nq
                        w = sg[g, r, at + last]
                        for e in range(acc.shape[2]):
                            acc[g, r, e] += w * as_float(vs[last, e])
            else:
                axpy4(sg, acc, i0, i1, i2, i3, nq, at, vs, nk, ahead)
            k += 4
        return k

    return impl


@njit(fastmath=FASTMATH, cache=True, nogil=True)
def group_values(sg, vs, acc, active, rows, n_heads, nq, nk, ahead, at, bf16_weights):
    """``acc[g, r] += sg[g, r, :nk] @ vs[:nk]`` for the heads ``g < n_heads`` with ``active[g]``
    and rows ``r < nq`` (values in float, or bf16 bits): four rows per pass over the values (on
    :func:`vector_group_values` where it applies), two keys per pass over the rows.  ``rows`` is
    work space for ``n_heads * nq`` row numbers; ``ahead`` and ``at`` (the weights are
    ``sg[g, r, at:at + nk]``) as in :func:`group_scores`.  ``bf16_weights``: the step's output is
    bf16, so 8-bit codes may be multiplied by weights rounded to bf16 (:func:`vector_group_values`)."""
    n_rows = 0
    for g in range(n_heads):
        if active[g]:
            for r in range(nq):
                rows[n_rows] = g * nq + r
                n_rows += 1
    k = vector_group_values(sg, vs, acc, rows, n_rows, nq, nk, ahead, at, bf16_weights)
    while k + 4 <= n_rows:
        i0, i1, i2, i3 = rows[k], rows[k + 1], rows[k + 2], rows[k + 3]
        w0, w1, w2, w3 = row(sg, i0, nq)[at:], row(sg, i1, nq)[at:], row(sg, i2, nq)[at:], row(sg, i3, nq)[at:]
        a0, a1, a2, a3 = row(acc, i0, nq), row(acc, i1, nq), row(acc, i2, nq), row(acc, i3, nq)
        c = 0
        while c + 2 <= nk:
            p0, p1, p2, p3 = w0[c], w1[c], w2[c], w3[c]
            n0, n1, n2, n3 = w0[c + 1], w1[c + 1], w2[c + 1], w3[c + 1]
            for e in range(a0.shape[0]):
                x = as_float(vs[c, e])
                y = as_float(vs[c + 1, e])
                a0[e] += p0 * x + n0 * y
                a1[e] += p1 * x + n1 * y
                a2[e] += p2 * x + n2 * y
                a3[e] += p3 * x + n3 * y
            c += 2
        for last in range(c, nk):
            p0, p1, p2, p3 = w0[last], w1[last], w2[last], w3[last]
            for e in range(a0.shape[0]):
                x = as_float(vs[last, e])
                a0[e] += p0 * x
                a1[e] += p1 * x
                a2[e] += p2 * x
                a3[e] += p3 * x
        k += 4
    # one row: four keys per pass over it (its accumulator's loads and stores, not the
    # multiplies, bound a one-key loop: half the time, float32 and bf16 alike)
    for rest in range(k, n_rows):
        w, a = row(sg, rows[rest], nq)[at:], row(acc, rows[rest], nq)
        c = 0
        while c + 4 <= nk:
            p0, p1, p2, p3 = w[c], w[c + 1], w[c + 2], w[c + 3]
            for e in range(a.shape[0]):
                pair = p0 * as_float(vs[c, e]) + p1 * as_float(vs[c + 1, e])
                a[e] += pair + (p2 * as_float(vs[c + 2, e]) + p3 * as_float(vs[c + 3, e]))
            c += 4
        for last in range(c, nk):
            p = w[last]
            for e in range(a.shape[0]):
                a[e] += p * as_float(vs[last, e])


# The backward multiplies tiles with ``gemm`` (BLAS in place, accumulating).  OpenBLAS's small
# products are fast as q @ k and slow as q @ kᵀ, so each key/value tile is transposed once.
@njit(cache=True, nogil=True)
def transpose_into(src, dst, n):  # dst[:, :n] = src[:n].T
    for c in range(n):
        for e in range(src.shape[1]):
            dst[e, c] = src[c, e]


@njit(fastmath=FASTMATH, cache=True, nogil=True)
def rescale_factor(m_old, m_new):
    """``2 ** (m_old - m_new)``: what a row's sum and accumulator are multiplied by when its
    reference max moves up (a call of its own: ``exp2`` is inlined, ``reference_max`` too)."""
    return exp2(m_old - m_new)


# inlined: a call passing five arrays per tile and head cost a decode step 14% on one core
@njit(fastmath=FASTMATH, cache=True, nogil=True, inline="always")
def reference_max(nq, m, total, acc, mx, m_safe, g, slack):
    """Each row's reference max ``m_safe`` for a tile whose row maxima are ``mx``.

    A row keeps its max ``m[g, r]`` while the tile's exceeds it by at most ``slack`` (``LAZY``:
    its weights stay below ``2**LAZY``, far from overflow); only when it grows more (or is
    NaN) are the max replaced and the row's weight sum ``total`` and accumulator
    rescaled -- after the first key blocks, rarely.  A slack of 0 keeps ``m`` the exact max
    (a kernel that returns each row's max score).
    """
    zero = m.dtype.type(0.0)
    lazy = m.dtype.type(slack)
    for r in range(nq):
        m_old = m[g, r]
        if mx[r] <= m_old + lazy:
            m_safe[r] = zero if m_old == -np.inf else m_old
        else:
            m_new = m_old if m_old > mx[r] else mx[r]
            m_safe[r] = zero if m_new == -np.inf else m_new
            alpha = rescale_factor(m_old, m_safe[r])
            m[g, r] = m_new
            total[g, r] *= alpha
            for e in range(acc.shape[2]):
                acc[g, r, e] *= alpha


@njit(fastmath=FASTMATH, cache=True, nogil=True)
def softmax_by_keys(st, nq, nk, m, total, acc, mx, m_safe, row_sum, g, slack):
    """The online softmax step of a transposed score tile ``st[c, r]`` (scores in base 2,
    row maxima ``mx``): ``st`` becomes the weights P and each row's sum is added to
    ``total[g]`` (the softmax's ``l``), vectorised over the rows; ``slack``: :func:`reference_max`'s."""
    prefer_wide_vectors()
    reference_max(nq, m, total, acc, mx, m_safe, g, slack)
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
def softmax_by_rows(sr, nq, nk, m, total, acc, mx, m_safe, g, slack):
    """As :func:`softmax_by_keys` for a row-major tile ``sr[r, c]`` (a few query rows),
    each row vectorised over its keys."""
    prefer_wide_vectors()
    reference_max(nq, m, total, acc, mx, m_safe, g, slack)
    for r in range(nq):
        m_row = m_safe[r]
        row_total = sr.dtype.type(0.0)
        for c in range(nk):
            p = exp2(sr.dtype.type(sr[r, c] - m_row))
            sr[r, c] = p
            row_total += p
        total[g, r] += row_total
