"""The decode step's grouped-row loops as explicit vector code (LLVM IR), where Numba's loops fall short.

A decode step multiplies four query rows (the heads of a GQA group and their new
tokens) with each key and value tile (``tile_math.group_scores``,
``group_values``).  Written as Numba loops, LLVM vectorises only the innermost
loop: the scores reduce each key's products across a vector's lanes, and the
values load and store the four accumulator rows for every pair of value rows.

``dots4(qb, r, ks, c)`` runs the scores on AVX-512 BF16's ``vdpbf16ps``, which
multiplies 32 pairs of bf16 elements and adds each pair's two products into
one of 16 float32 lanes: twice the products of a float32 FMA, from 16-bit
operands read as they are stored (no widening).  A product of two bf16 values
is exact in float32, so this differs from widened floats only in the order of
its float32 sums.  It takes four query rows and four key rows at a time (16
independent sums hide the instruction's latency) and adds the lanes of the 16
by a transposing tree.  ``HAS_BF16_DOT`` says whether the target Numba compiles
for has the instruction (the host's CPU, or ``NUMBA_CPU_NAME`` and
``NUMBA_CPU_FEATURES`` when set); without it the scores keep their float32
loops.  Numba's cache keys each kernel by the CPU's name and features, so a
cache built here is not loaded on a CPU without it.

``axpy4(sg, acc, i0, .., i3, nq, at, vs, nk, ahead)`` runs the values with 32
columns of the four accumulator rows in registers over all the value rows: one
read (and, for bf16, widening) of a value row's 32 elements feeds eight float32
FMAs.  The rows are given by number and addressed in the loop
(:func:`group_rows`), not as views.  It is plain vector code, for any CPU.
"""

from __future__ import annotations

from llvmlite import binding as llvm
from llvmlite import ir
from numba.core import cgutils, config, types
from numba.core.errors import TypingError
from numba.extending import intrinsic

#: bf16 elements per ``vdpbf16ps`` (a 512-bit register)
WIDTH = 32
#: key rows per call: 16 independent sums hide the instruction's latency
KEYS = 4


def target_features() -> str:
    if config.CPU_NAME:
        return config.CPU_FEATURES or ""
    return llvm.get_host_cpu_features().flatten()


#: whether the kernels are compiled for a CPU with AVX-512 BF16
HAS_BF16_DOT = "+avx512bf16" in target_features().split(",")


class _BFloat(ir.Type):
    """LLVM's ``bfloat`` (llvmlite has no type for it): only named in the intrinsic's signature."""

    def _to_string(self) -> str:
        return "bfloat"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _BFloat)

    def __hash__(self) -> int:
        return hash("bfloat")


F32X16 = ir.VectorType(ir.FloatType(), 16)
_I32x16 = ir.VectorType(ir.IntType(32), 16)
BF16X32 = ir.VectorType(_BFloat(), WIDTH)


_I8P = ir.IntType(8).as_pointer()
_I32 = ir.IntType(32)
_I64 = ir.IntType(64)


def i64(value: int) -> ir.Constant:
    return ir.Constant(_I64, value)


def array_view(context, builder, array_type, array) -> tuple[ir.Value, list[ir.Value], list[ir.Value]]:
    """An array's data as an ``i8*``, its shape and its strides (bytes)."""
    view = context.make_array(array_type)(context, builder, array)
    shape = cgutils.unpack_tuple(builder, view.shape, array_type.ndim)
    strides = cgutils.unpack_tuple(builder, view.strides, array_type.ndim)
    return builder.bitcast(view.data, _I8P), shape, strides


def offset_pointer(builder: ir.IRBuilder, base: ir.Value, *offsets: ir.Value) -> ir.Value:
    """``base`` (an ``i8*``) moved on by the sum of ``offsets`` bytes."""
    total = offsets[0]
    for offset in offsets[1:]:
        total = builder.add(total, offset)
    return builder.gep(base, [total])


def load_vector(builder: ir.IRBuilder, pointer: ir.Value, vector: ir.VectorType, align: int) -> ir.Value:
    return builder.load(builder.bitcast(pointer, vector.as_pointer()), align=align)


def prefetch_line(builder: ir.IRBuilder, pointer: ir.Value) -> None:
    """Prefetch the cache line at ``pointer`` (an ``i8*``) into L2, for reading."""
    fnty = ir.FunctionType(ir.VoidType(), [_I8P, _I32, _I32, _I32])
    prefetch = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
    builder.call(prefetch, [pointer, ir.Constant(_I32, 0), ir.Constant(_I32, 2), ir.Constant(_I32, 1)])


def pick_lanes(builder: ir.IRBuilder, a: ir.Value, b: ir.Value, lanes: list[int]) -> ir.Value:
    return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(_I32, len(lanes)), lanes))


def lane_sums(builder: ir.IRBuilder, vectors: list[ir.Value], per: int = 16) -> list[ir.Value]:
    """The 16 sums of float32 vectors of 16 lanes, each vector holding ``16 // per`` sums of ``per``
    lanes (lanes ``0 .. per - 1`` the first), in their order, by a transposing tree: each level adds
    pairs of vectors into one holding half as many partial sums of each (16 -> 8 -> 4 -> 2 -> 1
    lanes a sum): for 16 vectors of one sum, 30 shuffles and 15 adds in all."""
    while len(vectors) > 1:
        half = per // 2
        groups = 16 // per  # original vectors a vector holds
        lo = [g * per + i for g in range(groups) for i in range(half)]
        hi = [g * per + half + i for g in range(groups) for i in range(half)]
        merged = []
        for a, b in zip(vectors[0::2], vectors[1::2]):
            first = pick_lanes(builder, a, b, lo + [16 + i for i in lo])
            second = pick_lanes(builder, a, b, hi + [16 + i for i in hi])
            merged.append(builder.fadd(first, second))
        vectors, per = merged, half
    (total,) = vectors
    return [builder.extract_element(total, ir.Constant(_I32, i)) for i in range(16)]


def _bits_2d(name: str, array) -> None:
    if not (isinstance(array, types.Array) and array.ndim == 2 and array.dtype == types.uint16):
        raise TypingError(f"dots4: {name} must be a 2-d array of bf16 bits (uint16), got {array}")


@intrinsic
def dots4(typingctx, qb, r, ks, c, ahead):
    """The dot products of rows ``r .. r + 3`` of ``qb`` with key rows ``c .. c + 3`` of ``ks``, in
    float32: ``(qb[r] . ks[c], qb[r] . ks[c + 1], .., qb[r + 1] . ks[c], ..)``, 16 in all.  Both
    hold bf16 bits (uint16) in rows of a multiple of 32 elements, contiguous within a row;
    ``HAS_BF16_DOT`` must hold.  It prefetches key rows ``c + ahead .. c + ahead + 3`` (the next
    tile's, in a cache whose rows follow one another)."""
    _bits_2d("qb", qb)
    _bits_2d("ks", ks)
    result = types.UniTuple(types.float32, 4 * KEYS)

    def codegen(context, builder, signature, args):
        (q_base, q_shape, q_strides), _, (k_base, _, k_strides), _, _ = (
            array_view(context, builder, t, v) if isinstance(t, types.Array) else None
            for t, v in zip(signature.args, args)
        )
        r_i, c_i, ahead_i = (context.cast(builder, args[i], signature.args[i], types.intp) for i in (1, 3, 4))
        queries = [builder.mul(builder.add(r_i, i64(k)), q_strides[0]) for k in range(4)]
        keys = [builder.mul(builder.add(c_i, i64(j)), k_strides[0]) for j in range(KEYS)]
        later = builder.mul(ahead_i, k_strides[0])
        fnty = ir.FunctionType(F32X16, [F32X16, BF16X32, BF16X32])
        dp = cgutils.get_or_insert_function(builder.module, fnty, "llvm.x86.avx512bf16.dpbf16ps.512")
        sums = [cgutils.alloca_once(builder, F32X16) for _ in range(4 * KEYS)]
        for s in sums:
            builder.store(ir.Constant(F32X16, [0.0] * 16), s)
        chunks = builder.udiv(q_shape[1], i64(WIDTH))
        with cgutils.for_range(builder, chunks) as loop:
            offset = builder.mul(loop.index, i64(2 * WIDTH))  # bytes: a chunk is one cache line

            def bf16x32(base, row):
                return builder.bitcast(
                    load_vector(builder, offset_pointer(builder, base, row, offset), _I32x16, 2), BF16X32
                )

            k_chunks = [bf16x32(k_base, key) for key in keys]
            for key in keys:  # this chunk of the rows ``ahead`` on
                prefetch_line(builder, offset_pointer(builder, k_base, key, later, offset))
            for k, query in enumerate(queries):
                q_chunk = bf16x32(q_base, query)
                for j, k_chunk in enumerate(k_chunks):
                    s = sums[KEYS * k + j]
                    builder.store(builder.call(dp, [builder.load(s), q_chunk, k_chunk]), s)
        return context.make_tuple(builder, result, lane_sums(builder, [builder.load(s) for s in sums]))

    return result(qb, r, ks, c, ahead), codegen


#: an 8-bit cache's codes by their Numba type (``signatures.ELEMENT``) -> the power of two the
#: halves :func:`decode_codes` makes of them are the codes' values over: ``f8e4m3`` is rebiased by it
#: (``2 ** 8``), ``f8e5m2`` is the top byte of a half (1)
CODES = {types.uint8: 8, types.int8: 0}
#: each 8-bit cache type's codes as the kernels take them
NUMBA_CODES = {"f8e4m3": types.uint8, "f8e5m2": types.int8}


def code_scale(dtype) -> float:
    """What the floats :func:`decode_codes` gives must be multiplied by: ``2 ** 8`` for ``f8e4m3``."""
    return float(2 ** CODES[dtype])


def decode_codes(builder: ir.IRBuilder, codes: ir.Value, dtype) -> ir.Value:
    """8-bit codes (``CODES``; a scalar or a vector) as float32s: the codes' values divided by
    :func:`code_scale`.  The bits move into a half, which holds every code's value times ``2 ** -8``
    exactly, subnormals included, and the CPU's conversion widens it (``vcvtph2ps``): an ``f8e5m2``
    code is a half's top byte; an ``f8e4m3`` code, sign-extended to 16 bits and shifted left by 7,
    has its sign in bit 15, a copy of it in bit 14 (cleared) and its other bits below."""
    lanes = codes.type.count if isinstance(codes.type, ir.VectorType) else None

    def like(element: ir.Type) -> ir.Type:
        return element if lanes is None else ir.VectorType(element, lanes)

    def constant(value: int) -> ir.Constant:
        return ir.Constant(like(ir.IntType(16)), value if lanes is None else [value] * lanes)

    if CODES[dtype] == 0:
        bits = builder.shl(builder.zext(codes, like(ir.IntType(16))), constant(8))
    else:
        wide = builder.sext(codes, like(ir.IntType(16)))
        bits = builder.and_(builder.shl(wide, constant(7)), constant(0xBF80))
    return builder.fpext(builder.bitcast(bits, like(ir.HalfType())), like(ir.FloatType()))


@intrinsic
def code_to_f32(typingctx, code):
    """One 8-bit code (``CODES``) as :func:`decode_codes` gives it."""
    if code not in CODES:
        raise TypingError(f"code_to_f32: an 8-bit code (uint8 or int8), got {code}")
    dtype = code

    def codegen(context, builder, signature, args):
        return decode_codes(builder, args[0], dtype)

    return types.float32(code), codegen


def _codes_2d(name: str, array) -> None:
    if not (isinstance(array, types.Array) and array.ndim == 2 and array.dtype in CODES):
        raise TypingError(f"{name} must be a 2-d array of 8-bit codes (uint8 or int8), got {array}")


@intrinsic
def code_dots4(typingctx, q0, q1, q2, q3, ks, c, ahead):
    """The dot products of the float32 rows ``q0 .. q3`` with the rows ``c .. c + 3`` of ``ks``, 8-bit
    codes (``CODES``) decoded as read, in float32: ``(q0 . ks[c], q0 . ks[c + 1], .., q1 . ks[c], ..)``,
    16 in all, each to be multiplied by ``code_scale`` (and the key's scale).  Rows a multiple of 16
    long, contiguous.  It prefetches key rows ``c + ahead .. c + ahead + 3``."""
    for array in (q0, q1, q2, q3):
        if not (isinstance(array, types.Array) and array.ndim == 1 and array.dtype == types.float32):
            raise TypingError(f"code_dots4: query rows must be 1-d float32 arrays, got {array}")
    _codes_2d("code_dots4: ks", ks)
    result = types.UniTuple(types.float32, 4 * KEYS)
    dtype = ks.dtype

    def codegen(context, builder, signature, args):
        rows = [array_view(context, builder, t, v)[0] for t, v in zip(signature.args[:4], args[:4])]
        k_base, k_shape, k_strides = array_view(context, builder, signature.args[4], args[4])
        c_i, ahead_i = (context.cast(builder, args[i], signature.args[i], types.intp) for i in (5, 6))
        keys = [builder.mul(builder.add(c_i, i64(j)), k_strides[0]) for j in range(KEYS)]
        later = builder.mul(ahead_i, k_strides[0])
        fma = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(F32X16, [F32X16] * 3), "llvm.fmuladd.v16f32"
        )
        sums = [cgutils.alloca_once(builder, F32X16) for _ in range(4 * KEYS)]
        for s in sums:
            builder.store(ir.Constant(F32X16, [0.0] * 16), s)
        with cgutils.for_range(builder, builder.udiv(k_shape[1], i64(16))) as loop:
            offset = builder.mul(loop.index, i64(16))  # bytes into a row of codes
            i8x16 = ir.VectorType(ir.IntType(8), 16)
            k_chunks = [
                decode_codes(
                    builder, load_vector(builder, offset_pointer(builder, k_base, key, offset), i8x16, 1), dtype
                )
                for key in keys
            ]
            for key in keys:  # this chunk of the rows ``ahead`` on
                prefetch_line(builder, offset_pointer(builder, k_base, key, later, offset))
            for k, base in enumerate(rows):
                q_chunk = load_vector(builder, offset_pointer(builder, base, builder.mul(offset, i64(4))), F32X16, 4)
                for j, k_chunk in enumerate(k_chunks):
                    s = sums[KEYS * k + j]
                    builder.store(builder.call(fma, [q_chunk, k_chunk, builder.load(s)]), s)
        return context.make_tuple(builder, result, lane_sums(builder, [builder.load(s) for s in sums]))

    return result(q0, q1, q2, q3, ks, c, ahead), codegen


@intrinsic
def f32_bits(typingctx, x):
    """The bits of the float32 ``x``, as a uint32."""

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], _I32)

    return types.uint32(types.float32), codegen


def check_group_rows(name: str, sg, acc, indices) -> None:
    """The typing check of a loop over four rows of a group: ``sg`` and ``acc`` 3-d float32 arrays,
    integer row numbers, row length, first weight."""
    for array in (sg, acc):
        if not (isinstance(array, types.Array) and array.ndim == 3 and array.dtype == types.float32):
            raise TypingError(f"{name}: the weights and the accumulator must be 3-d float32 arrays, got {array}")
    for index in indices:
        if not isinstance(index, types.Integer):
            raise TypingError(f"{name}: row numbers, row length and first weight must be integers, got {index}")


def group_rows(context, builder, signature, args) -> tuple[list, list, ir.Value]:
    """Where the four rows of ``(sg, acc, i0, i1, i2, i3, nq, at, ...)`` are: for each row ``i``
    (head ``i // nq``, query row ``i % nq``), its weights ``sg[i // nq, i % nq, at:]`` as
    ``(address, stride)`` and its accumulator row ``acc[i // nq, i % nq]``'s address; and the
    rows' length.  Addresses, not views: a view made in compiled code costs reference counts."""
    sg_base, _, sg_strides = array_view(context, builder, signature.args[0], args[0])
    acc_base, acc_shape, acc_strides = array_view(context, builder, signature.args[1], args[1])
    nq, at = (context.cast(builder, args[i], signature.args[i], types.intp) for i in (6, 7))
    weights, rows = [], []
    for i in range(2, 6):
        index = context.cast(builder, args[i], signature.args[i], types.intp)
        head, query = builder.sdiv(index, nq), builder.srem(index, nq)
        sg_at = [builder.mul(head, sg_strides[0]), builder.mul(query, sg_strides[1]), builder.mul(at, sg_strides[2])]
        weights.append((offset_pointer(builder, sg_base, *sg_at), sg_strides[2]))
        rows.append(
            offset_pointer(builder, acc_base, builder.mul(head, acc_strides[0]), builder.mul(query, acc_strides[1]))
        )
    return weights, rows, acc_shape[2]


@intrinsic
def axpy4(typingctx, sg, acc, i0, i1, i2, i3, nq, at, vs, nk, ahead):
    """``acc[i // nq, i % nq, e] += sum(sg[i // nq, i % nq, at + c] * vs[c, e] for c < nk)`` for the
    four rows ``i`` of ``i0 .. i3`` (:func:`group_rows`; accumulator rows contiguous, a multiple of
    32 long); ``vs`` holds float32 values, bf16 bits (uint16) or 8-bit codes (``CODES``: the weights
    then include ``code_scale``), contiguous within a row.  It prefetches value rows ``ahead`` on
    (the next tile's)."""
    check_group_rows("axpy4", sg, acc, (i0, i1, i2, i3, nq, at))
    if not (isinstance(vs, types.Array) and vs.ndim == 2 and vs.dtype in (types.uint16, types.float32, *CODES)):
        raise TypingError(f"axpy4: vs must be a 2-d array of float32, bf16 bits (uint16) or 8-bit codes, got {vs}")
    size = vs.dtype.bitwidth // 8  # bytes an element

    def codegen(context, builder, signature, args):
        f32x32 = ir.VectorType(ir.FloatType(), WIDTH)
        weights, rows, n_e = group_rows(context, builder, signature, args)
        v_base, _, v_strides = array_view(context, builder, signature.args[8], args[8])
        n_keys, ahead = (context.cast(builder, args[i], signature.args[i], types.intp) for i in (9, 10))
        later = builder.mul(ahead, v_strides[0])
        fma = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(f32x32, [f32x32] * 3), f"llvm.fmuladd.v{WIDTH}f32"
        )
        sums = [cgutils.alloca_once(builder, f32x32) for _ in range(4)]
        with cgutils.for_range(builder, builder.udiv(n_e, i64(WIDTH))) as chunk:
            row_offset = builder.mul(chunk.index, i64(4 * WIDTH))  # bytes into a float32 row
            places = [builder.bitcast(offset_pointer(builder, base, row_offset), f32x32.as_pointer()) for base in rows]
            for place, s in zip(places, sums):
                builder.store(builder.load(place, align=4), s)
            value_offset = builder.mul(chunk.index, i64(size * WIDTH))
            with cgutils.for_range(builder, n_keys) as key:
                at = builder.add(builder.mul(key.index, v_strides[0]), value_offset)
                if size == 2:  # bf16: the bits, shifted to the top of float32s
                    i32x32 = ir.VectorType(_I32, WIDTH)
                    wide = builder.zext(
                        load_vector(
                            builder, offset_pointer(builder, v_base, at), ir.VectorType(ir.IntType(16), WIDTH), 2
                        ),
                        i32x32,
                    )
                    values = builder.bitcast(builder.shl(wide, ir.Constant(i32x32, [16] * WIDTH)), f32x32)
                elif size == 1:  # 8-bit codes
                    codes = load_vector(
                        builder, offset_pointer(builder, v_base, at), ir.VectorType(ir.IntType(8), WIDTH), 1
                    )
                    values = decode_codes(builder, codes, vs.dtype)
                else:
                    values = load_vector(builder, offset_pointer(builder, v_base, at), f32x32, 4)
                for line in range(0, size * WIDTH, 64):  # this chunk of the row ``ahead`` on
                    prefetch_line(builder, offset_pointer(builder, v_base, at, later, i64(line)))
                for (w_base, w_stride), s in zip(weights, sums):
                    w = builder.load(
                        builder.bitcast(
                            offset_pointer(builder, w_base, builder.mul(key.index, w_stride)),
                            ir.FloatType().as_pointer(),
                        )
                    )
                    splat = builder.shuffle_vector(
                        builder.insert_element(ir.Constant(f32x32, None), w, ir.Constant(_I32, 0)),
                        ir.Constant(f32x32, None),
                        ir.Constant(ir.VectorType(_I32, WIDTH), [0] * WIDTH),
                    )
                    builder.store(builder.call(fma, [splat, values, builder.load(s)]), s)
            for place, s in zip(places, sums):
                builder.store(builder.load(s), place, align=4)
        return context.get_dummy_value()

    return types.none(sg, acc, i0, i1, i2, i3, nq, at, vs, nk, ahead), codegen


@intrinsic
def prefetch_row(typingctx, array, index):
    """Prefetch row ``index`` of a 2-d array (rows contiguous) into L2, a cache line at a time: the
    next tile's rows, while the loops over this one's compute."""
    if not (isinstance(array, types.Array) and array.ndim == 2):
        raise TypingError(f"prefetch_row: a 2-d array, got {array}")
    size = array.dtype.bitwidth // 8

    def codegen(context, builder, signature, args):
        base, shape, strides = array_view(context, builder, signature.args[0], args[0])
        at = builder.mul(context.cast(builder, args[1], signature.args[1], types.intp), strides[0])
        with cgutils.for_range_slice(builder, i64(0), builder.mul(shape[1], i64(size)), i64(64)) as (line, _):
            prefetch_line(builder, offset_pointer(builder, base, at, line))
        return context.get_dummy_value()

    return types.none(array, index), codegen
