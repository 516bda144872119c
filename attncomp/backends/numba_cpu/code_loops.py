"""A decode step's loops over an 8-bit cache on the CPU's bf16 dot products (LLVM IR).

An 8-bit code (``f8e4m3`` or ``f8e5m2``) is exactly a bf16 value: 3 or 2 mantissa bits and a
range that bf16's 8 exponent bits cover, subnormals included.  :func:`decode_bf16` turns 64 codes
into 64 bf16 elements with two byte-table lookups (AVX-512 VBMI's ``vpermi2b``: a 128-entry table
of bytes, indexed by each code's low 7 bits): the high and the low byte of each code's bf16 value,
without its sign, which the high byte takes from the code.  Four instructions for 64 codes, where
widening through halves to float32 (``vector_loops.decode_codes``) takes about 16.

``bf16_code_dots4`` then runs the scores as ``vector_loops.dots4`` runs bf16 keys: ``vdpbf16ps``,
32 products an instruction, from the query rows as bf16 bits (``tile_math.bf16_query_rows``):
a bf16 query element times a code is exact in float32, so the scores differ from the float32
loops only in the order of their sums.  ``bf16_code_axpy4`` runs the values on ``vdpbf16ps`` too,
over pairs of value rows: each pair of weights is rounded to bf16 (as FlashAttention multiplies
its probabilities with the values), so it is used only where the step's output is bf16, whose
own rounding is of the same size (``tile_math.group_values``' ``bf16_weights``).

The tables hold each code's value over ``vector_loops.code_scale`` (``2 ** -8`` times it for
``f8e4m3``), as the other loops over codes give it: the kernels multiply each key's scale by the
same factor whichever loop ran.  ``HAS_CODE_TABLES`` says whether the target CPU has both
instruction sets; without them the codes keep the float32 loops.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.core.errors import TypingError
from numba.extending import intrinsic

from attncomp.backends.numba_cpu.vector_loops import (
    BF16X32,
    CODES,
    F32X16,
    HAS_BF16_DOT,
    KEYS,
    array_view,
    check_group_rows,
    code_scale,
    group_rows,
    i64,
    lane_sums,
    load_vector,
    offset_pointer,
    pick_lanes,
    prefetch_line,
    target_features,
)

#: whether the kernels are compiled for a CPU with AVX-512 BF16 and VBMI (byte tables)
HAS_CODE_TABLES = HAS_BF16_DOT and "+avx512vbmi" in target_features().split(",")

#: each 8-bit code type's values as stored (``vector_loops.CODES``)
FLOAT8 = {types.uint8: ml_dtypes.float8_e4m3fn, types.int8: ml_dtypes.float8_e5m2}

_I8x64 = ir.VectorType(ir.IntType(8), 64)
_I8x32 = ir.VectorType(ir.IntType(8), 32)


def code_table(dtype) -> np.ndarray:
    """The bf16 bits (uint16) of the codes ``0 .. 127`` of an 8-bit type (``vector_loops.CODES``):
    their values over ``code_scale``, exactly."""
    values = np.arange(128, dtype=np.uint8).view(FLOAT8[dtype]).astype(np.float32) / code_scale(dtype)
    bits = values.astype(ml_dtypes.bfloat16)
    if not np.array_equal(bits.astype(np.float32), values, equal_nan=True):
        raise AssertionError(f"the {FLOAT8[dtype].__name__} codes are not all bf16 values")
    return bits.view(np.uint16)


def _table_halves(table: np.ndarray) -> list[ir.Constant]:
    """A table of 128 bytes as the two 64-byte operands of ``vpermi2b``."""
    return [ir.Constant(_I8x64, [int(b) for b in table[at : at + 64]]) for at in (0, 64)]


def decode_bf16(builder: ir.IRBuilder, codes: ir.Value, dtype, halves: bool = False) -> tuple[ir.Value, ir.Value]:
    """64 codes (an ``<64 x i8>``) as their bf16 values (:func:`code_table`), two ``<32 x bfloat>``:
    codes ``0 .. 31`` and ``32 .. 63``, in order; with ``halves``, codes ``0 .. 15, 32 .. 47`` and
    ``16 .. 31, 48 .. 63`` (each half of the codes a row's 32, split in two)."""
    lookup = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(_I8x64, [_I8x64] * 3), "llvm.x86.avx512.vpermi2var.qi.512"
    )
    table = code_table(dtype)
    high_lo, high_hi = _table_halves((table >> 8).astype(np.uint8))
    low_lo, low_hi = _table_halves((table & 0xFF).astype(np.uint8))
    sign = builder.and_(codes, ir.Constant(_I8x64, [0x80] * 64))
    high = builder.or_(builder.call(lookup, [high_lo, codes, high_hi]), sign)
    low = builder.call(lookup, [low_lo, codes, low_hi])
    groups = (
        [[*range(0, 16), *range(32, 48)], [*range(16, 32), *range(48, 64)]] if halves else [range(32), range(32, 64)]
    )
    words = []
    for group in groups:  # little-endian: each element's low byte first
        lanes = [lane for i in group for lane in (i, 64 + i)]
        words.append(builder.bitcast(pick_lanes(builder, low, high, lanes), BF16X32))
    return words[0], words[1]


def _dot(builder: ir.IRBuilder) -> ir.Function:
    fnty = ir.FunctionType(F32X16, [F32X16, BF16X32, BF16X32])
    return cgutils.get_or_insert_function(builder.module, fnty, "llvm.x86.avx512bf16.dpbf16ps.512")


def _check(name: str, array, dtypes: tuple, what: str) -> None:
    if not (isinstance(array, types.Array) and array.ndim == 2 and array.dtype in dtypes):
        raise TypingError(f"{name} must be a 2-d array of {what}, got {array}")


@intrinsic
def bf16_code_dots4(typingctx, qb, r, ks, c, ahead):
    """``vector_loops.dots4`` over 8-bit codes: the dot products of rows ``r .. r + 3`` of ``qb``
    (bf16 bits) with the codes' rows ``c .. c + 3`` of ``ks``, their values over ``code_scale``,
    16 in all.  Rows a multiple of 32 long, contiguous; ``HAS_CODE_TABLES`` must hold.  It
    prefetches key rows ``c + ahead .. c + ahead + 3``.

    Two keys share an accumulator: 32 codes of each are decoded together, into bf16 vectors of 16
    elements of the one key and then 16 of the other, multiplied with the query's 16 elements
    twice over (a 256-bit load broadcast), so that lanes 0 .. 7 sum the first key's products and
    8 .. 15 the second's.  Eight accumulators, not 16, and a tree of three levels, not four."""
    _check("bf16_code_dots4: qb", qb, (types.uint16,), "bf16 bits (uint16)")
    _check("bf16_code_dots4: ks", ks, tuple(CODES), "8-bit codes (uint8 or int8)")
    result = types.UniTuple(types.float32, 4 * KEYS)
    dtype = ks.dtype

    def codegen(context, builder, signature, args):
        q_base, q_shape, q_strides = array_view(context, builder, signature.args[0], args[0])
        k_base, k_shape, k_strides = array_view(context, builder, signature.args[2], args[2])
        r_i, c_i, ahead_i = (context.cast(builder, args[i], signature.args[i], types.intp) for i in (1, 3, 4))
        queries = [builder.mul(builder.add(r_i, i64(k)), q_strides[0]) for k in range(4)]
        keys = [builder.mul(builder.add(c_i, i64(j)), k_strides[0]) for j in range(KEYS)]
        later = builder.mul(ahead_i, k_strides[0])
        dot = _dot(builder)
        pairs = KEYS // 2
        sums = [cgutils.alloca_once(builder, F32X16) for _ in range(4 * pairs)]
        for s in sums:
            builder.store(ir.Constant(F32X16, [0.0] * 16), s)
        i16x16 = ir.VectorType(ir.IntType(16), 16)
        with cgutils.for_range(builder, builder.udiv(k_shape[1], i64(32))) as loop:
            offset = builder.mul(loop.index, i64(32))  # codes into a key row
            k_words = []
            for p in range(pairs):
                first, second = (
                    load_vector(builder, offset_pointer(builder, k_base, keys[2 * p + i], offset), _I8x32, 1)
                    for i in (0, 1)
                )
                both = pick_lanes(builder, first, second, list(range(64)))
                low, high = decode_bf16(builder, both, dtype, halves=True)
                k_words.append((low, high))
            for key in keys:
                prefetch_line(builder, offset_pointer(builder, k_base, key, later, offset))
            for k, query in enumerate(queries):
                at = offset_pointer(builder, q_base, query, builder.mul(offset, i64(2)))
                halves = []
                for i in (0, 1):  # the query's elements 0 .. 15 and 16 .. 31 of the chunk, each twice
                    part = load_vector(builder, offset_pointer(builder, at, i64(32 * i)), i16x16, 2)
                    halves.append(builder.bitcast(pick_lanes(builder, part, part, list(range(16)) * 2), BF16X32))
                for p, words in enumerate(k_words):
                    s = sums[pairs * k + p]
                    total = builder.load(s)
                    for half, word in zip(halves, words):
                        total = builder.call(dot, [total, half, word])
                    builder.store(total, s)
        return context.make_tuple(builder, result, lane_sums(builder, [builder.load(s) for s in sums], per=8))

    return result(qb, r, ks, c, ahead), codegen


@intrinsic
def bf16_code_axpy4(typingctx, sg, acc, i0, i1, i2, i3, nq, at, vs, nk, ahead):
    """``vector_loops.axpy4`` over 8-bit codes ``vs`` (their values over ``code_scale``), for keys
    ``c < nk - nk % 2``, a pair of value rows at a time on ``vdpbf16ps``: each pair of weights
    rounded to bf16 (to nearest even), the weights of a row contiguous.  Rows a multiple of 32
    long, contiguous; ``HAS_CODE_TABLES`` must hold.  An odd last row is left to the caller.  It
    prefetches value rows ``ahead`` on."""
    check_group_rows("bf16_code_axpy4", sg, acc, (i0, i1, i2, i3, nq, at))
    _check("bf16_code_axpy4: vs", vs, tuple(CODES), "8-bit codes (uint8 or int8)")
    dtype = vs.dtype

    def codegen(context, builder, signature, args):
        weights, rows, n_e = group_rows(context, builder, signature, args)
        v_base, _, v_strides = array_view(context, builder, signature.args[8], args[8])
        n_keys, ahead_i = (context.cast(builder, args[i], signature.args[i], types.intp) for i in (9, 10))
        later = builder.mul(ahead_i, v_strides[0])
        dot = _dot(builder)
        to_bf16 = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(BF16X32, [F32X16] * 2), "llvm.x86.avx512bf16.cvtne2ps2bf16.512"
        )
        f32x2 = ir.VectorType(ir.FloatType(), 2)

        def chunk(offset: ir.Value, width: int) -> None:
            """Columns ``offset .. offset + width`` (32 or 64) of the four rows, over every pair."""
            parts = width // 16  # float32 vectors a row
            sums = [cgutils.alloca_once(builder, F32X16) for _ in range(4 * parts)]
            places = [
                builder.bitcast(
                    offset_pointer(builder, base, builder.mul(offset, i64(4)), i64(64 * p)), F32X16.as_pointer()
                )
                for base in rows
                for p in range(parts)
            ]
            for place, s in zip(places, sums):
                builder.store(builder.load(place, align=4), s)
            code_vector = ir.VectorType(ir.IntType(8), width)
            with cgutils.for_range(builder, builder.udiv(n_keys, i64(2))) as pair:
                first = builder.mul(builder.mul(pair.index, i64(2)), v_strides[0])
                second = builder.add(first, v_strides[0])
                codes = [
                    load_vector(builder, offset_pointer(builder, v_base, row, offset), code_vector, 1)
                    for row in (first, second)
                ]
                for row in (first, second):
                    prefetch_line(builder, offset_pointer(builder, v_base, row, later, offset))
                values = []  # the pair's elements side by side: (vs[c, e], vs[c + 1, e]) for each column e
                for at in range(0, width, 32):
                    lanes = [lane for e in range(at, at + 32) for lane in (e, width + e)]
                    values.extend(decode_bf16(builder, pick_lanes(builder, codes[0], codes[1], lanes), dtype))
                for k, (w_base, w_stride) in enumerate(weights):
                    w_at = offset_pointer(builder, w_base, builder.mul(builder.mul(pair.index, i64(2)), w_stride))
                    pair_w = builder.load(builder.bitcast(w_at, f32x2.as_pointer()), align=4)
                    spread = pick_lanes(builder, pair_w, pair_w, [0, 1] * 8)
                    w_bf16 = builder.call(to_bf16, [spread, spread])
                    for p in range(parts):
                        s = sums[parts * k + p]
                        builder.store(builder.call(dot, [builder.load(s), w_bf16, values[p]]), s)
            for place, s in zip(places, sums):
                builder.store(builder.load(s), place, align=4)

        with cgutils.for_range(builder, builder.udiv(n_e, i64(64))) as loop:
            chunk(builder.mul(loop.index, i64(64)), 64)
        with builder.if_then(builder.icmp_unsigned("!=", builder.urem(n_e, i64(64)), i64(0))):
            chunk(builder.sub(n_e, i64(32)), 32)
        return context.get_dummy_value()

    return types.none(sg, acc, i0, i1, i2, i3, nq, at, vs, nk, ahead), codegen
