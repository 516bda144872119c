"""Warp-level instructions on the GPU: PTX through LLVM inline assembly (``llvmlite.ir.InlineAsm``).

Numba-CUDA has no tensor-core API; each instruction here is a Numba
intrinsic whose code is one PTX instruction, so the fragments stay in
registers (a device function linked in through ``link=`` would pass them
through local memory).  Every instruction goes through :func:`call_asm`: a warp-synchronous one
(``.sync``) is a ``convergent`` call, which LLVM may not move into divergent code, and one that
touches memory has side effects.  ``mma/warp_sim.py`` runs the same instructions under
Numba's CUDA simulator, with the same fragment layout (``mma/atoms.py``).
"""

from __future__ import annotations

from llvmlite import ir
from numba.cuda import types
from numba.cuda.extending import intrinsic
from numba.cuda.typing import signature

from attncomp.backends.numba_cuda.mma.atoms import LDMATRIX_X4, LDMATRIX_X4_TRANS, M16N8K8_TF32, M16N8K16

_F32 = ir.FloatType()
_I32 = ir.IntType(32)
_FRAGMENT = types.UniTuple(types.float32, 4)

#: PTX opcodes that read or write memory (or order it): their inline assembly has side effects
MEMORY_OPCODES = ("ld", "st", "atom", "red", "cp", "ldmatrix", "stmatrix", "bar", "barrier", "fence", "membar")


def asm_flags(text: str) -> tuple[bool, bool]:
    """(convergent, side effects) of one PTX instruction.  Convergent: a warp-synchronous instruction
    (``.sync``: ``mma.sync``, ``shfl.sync``), which every lane of the warp must execute together, so
    LLVM may not move it into (or out of) code that only some lanes run.  Side effects: it touches
    memory, so LLVM may neither drop it nor reorder it across other memory operations."""
    opcode = text.split(None, 1)[0]
    parts = opcode.split(".")
    return ".sync" in opcode, parts[0] in MEMORY_OPCODES


def call_asm(builder: ir.IRBuilder, fnty: ir.FunctionType, text: str, constraints: str, args: list):
    """Call one PTX instruction as LLVM inline assembly, marked as :func:`asm_flags` says."""
    convergent, side_effect = asm_flags(text)
    asm = ir.InlineAsm(fnty, text, constraints, side_effect=side_effect)
    return builder.call(asm, args, attrs=("convergent",) if convergent else ())


def _mma(shape: str, element: str):
    """``mma.sync.aligned.{shape}.row.col.f32.{element}.{element}.f32``: D = A B + C for one warp.

    A is four 32-bit registers, B two, C and D four float32 (layouts in ``mma/atoms.py``): for
    ``m16n8k16`` a register holds two 16-bit elements (A 16 x 16, B 16 x 8); for ``m16n8k8`` in
    tf32 one element (A 16 x 8, B 8 x 8), float32 bits whose low 13 are zero (``warp.tf32_round``)."""
    text = (
        f"mma.sync.aligned.{shape}.row.col.f32.{element}.{element}.f32 "
        "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};"
    )
    constraints = ",".join(["=f"] * 4 + ["r"] * 6 + ["f"] * 4)

    @intrinsic
    def mma(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        sig = signature(_FRAGMENT, *([types.uint32] * 6 + [types.float32] * 4))

        def codegen(context, builder, sig, args):
            fnty = ir.FunctionType(ir.LiteralStructType([_F32] * 4), [_I32] * 6 + [_F32] * 4)
            result = call_asm(builder, fnty, text, constraints, list(args))
            parts = [builder.extract_value(result, k) for k in range(4)]
            return context.make_tuple(builder, sig.return_type, parts)

        return sig, codegen

    return mma


mma_f16 = _mma(M16N8K16.shape, "f16")
mma_bf16 = _mma(M16N8K16.shape, "bf16")
mma_tf32 = _mma(M16N8K8_TF32.shape, "tf32")


@intrinsic
def f32_bits(typingctx, x):
    """The 32 bits of a float32, as a uint32 (no conversion)."""
    sig = signature(types.uint32, types.float32)

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], _I32)

    return sig, codegen


@intrinsic
def bits_f32(typingctx, bits):
    """The float32 whose bits a uint32 holds."""
    sig = signature(types.float32, types.uint32)

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], _F32)

    return sig, codegen


def _pack_x2(element: str):
    """``cvt.rn.{element}x2.f32``: two float32 rounded (to nearest even) into one 32-bit register,
    ``lo`` in its low half (the first of a fragment's element pair)."""

    @intrinsic
    def pack(typingctx, lo, hi):
        sig = signature(types.uint32, types.float32, types.float32)

        def codegen(context, builder, sig, args):
            fnty = ir.FunctionType(_I32, [_F32, _F32])
            # the first source goes to the high half
            return call_asm(builder, fnty, f"cvt.rn.{element}x2.f32 $0, $1, $2;", "=r,f,f", [args[1], args[0]])

        return sig, codegen

    return pack


pack_f16x2 = _pack_x2("f16")
pack_bf16x2 = _pack_x2("bf16")


@intrinsic
def pack_halves(typingctx, lo, hi):
    """Two float16 values as one 32-bit register (``lo`` in the low half): their bits, unconverted."""
    sig = signature(types.uint32, types.float16, types.float16)

    def codegen(context, builder, sig, args):
        # Numba keeps a float16 as its 16 bits (an i16)
        lo, hi = (builder.zext(builder.bitcast(a, ir.IntType(16)), _I32) for a in args)
        return builder.or_(lo, builder.shl(hi, ir.Constant(_I32, 16)))

    return sig, codegen


@intrinsic
def pack_bits(typingctx, lo, hi):
    """Two 16-bit patterns (bf16 values kept as uint16 or int16) as one 32-bit register, ``lo`` low."""
    sig = signature(types.uint32, types.uint16, types.uint16)

    def codegen(context, builder, sig, args):
        lo, hi = (builder.zext(a, _I32) for a in args)
        return builder.or_(lo, builder.shl(hi, ir.Constant(_I32, 16)))

    return sig, codegen


@intrinsic
def widen_bf16(typingctx, bits):
    """The float32 a bf16 is, from its 16-bit pattern (uint16 or int16): the bits moved to the top."""
    sig = signature(types.float32, types.uint16)

    def codegen(context, builder, sig, args):
        word = builder.shl(builder.zext(args[0], _I32), ir.Constant(_I32, 16))
        return builder.bitcast(word, _F32)

    return sig, codegen


@intrinsic
def shuffle_xor(typingctx, value, mask):
    """``shfl.sync.bfly.b32``: the float32 of lane ``lane ^ mask`` (within a quad for masks 1 and 2)."""
    sig = signature(types.float32, types.float32, types.int32)

    def codegen(context, builder, sig, args):
        fnty = ir.FunctionType(_F32, [_F32, _I32])
        return call_asm(builder, fnty, "shfl.sync.bfly.b32 $0, $1, $2, 0x1f, 0xffffffff;", "=f,f,r", list(args))

    return sig, codegen


def _special_function(name: str, instruction: str, doc: str):
    """An intrinsic of one float32 special-function-unit instruction, ``instruction $0, $1``."""

    def function(typingctx, x):
        def codegen(context, builder, sig, args):
            fnty = ir.FunctionType(_F32, [_F32])
            return call_asm(builder, fnty, f"{instruction} $0, $1;", "=f,f", list(args))

        return signature(types.float32, types.float32), codegen

    function.__name__ = function.__qualname__ = name
    function.__doc__ = f"``{instruction}``: {doc}"
    return intrinsic(function)


exp2_approx = _special_function(
    "exp2_approx", "ex2.approx.ftz.f32", "2 to the power ``x`` (relative error about 2^-22; -inf gives 0)."
)
log2_approx = _special_function(
    "log2_approx",
    "lg2.approx.f32",
    "the base-2 logarithm of ``x`` (absolute error about 2^-22 near 1, relative elsewhere; 0 gives -inf, "
    "a negative NaN; subnormals kept, no ``.ftz``).",
)
rcp_approx = _special_function(
    "rcp_approx",
    "rcp.approx.ftz.f32",
    "``1 / x`` (at most one unit in the last place off; a 16-bit output's rounding is 2^13 times coarser).",
)


def _tf32(builder, word):
    """float32 bits rounded to tf32's 10 fraction bits (to nearest, ties away from zero)."""
    return builder.and_(builder.add(word, ir.Constant(_I32, 0x1000)), ir.Constant(_I32, 0xFFFFE000))


# Integer arithmetic written as intrinsics rather than device functions: Numba inlines a device
# function (``inline="always"``) by re-running its passes at every call site, and a 3xTF32 kernel
# rounds at some eighty of them; an intrinsic is typed once and costs nothing to inline.
@intrinsic
def tf32_round(typingctx, x):
    """``x`` (any number) as float32, rounded to tf32, as float32 bits (``warp.py``)."""
    sig = signature(types.uint32, types.unliteral(x))

    def codegen(context, builder, sig, args):
        value = context.cast(builder, args[0], sig.args[0], types.float32)
        return _tf32(builder, builder.bitcast(value, _I32))

    return sig, codegen


@intrinsic
def tf32_rest(typingctx, x, big):
    """What ``big`` (tf32 bits) missed of ``x`` (as float32), rounded to tf32, as float32 bits."""
    sig = signature(types.uint32, types.unliteral(x), types.unliteral(big))

    def codegen(context, builder, sig, args):
        value = context.cast(builder, args[0], sig.args[0], types.float32)
        word = context.cast(builder, args[1], sig.args[1], types.uint32)
        rest = builder.fsub(value, builder.bitcast(word, _F32))
        return _tf32(builder, builder.bitcast(rest, _I32))

    return sig, codegen


@intrinsic
def round_bf16(typingctx, x):
    """``x`` (as float32) rounded to bf16, to nearest even, as its 16-bit pattern; NaN stays NaN
    (quieted), past bf16's range infinity (``warp.py``)."""
    sig = signature(types.uint16, types.unliteral(x))

    def codegen(context, builder, sig, args):
        value = context.cast(builder, args[0], sig.args[0], types.float32)
        bits = builder.bitcast(value, _I32)
        top = builder.lshr(bits, ir.Constant(_I32, 16))
        magnitude = builder.and_(bits, ir.Constant(_I32, 0x7FFFFFFF))
        nan = builder.icmp_unsigned(">", magnitude, ir.Constant(_I32, 0x7F800000))
        quiet = builder.or_(top, ir.Constant(_I32, 0x40))
        odd = builder.and_(top, ir.Constant(_I32, 1))
        rounded = builder.lshr(builder.add(builder.add(bits, ir.Constant(_I32, 0x7FFF)), odd), ir.Constant(_I32, 16))
        return builder.trunc(builder.select(nan, quiet, rounded), ir.IntType(16))

    return sig, codegen


def _shared_address(context, builder, array_type, array, byte):
    """The 32-bit shared-window address of byte ``byte`` (a uint32) of a shared array: the array's
    generic data pointer cast back to the shared state space (``cvta.to.shared``, loop-invariant)."""
    data = context.make_array(array_type)(context, builder, array).data
    shared = builder.addrspacecast(data, ir.PointerType(data.type.pointee, 3))
    return builder.add(builder.ptrtoint(shared, _I32), byte)


def _uint32(context, builder, value, value_type):
    return context.cast(builder, value, value_type, types.uint32)


@intrinsic
def cp_async16(typingctx, dst, dst_byte, src, src_elem, src_bytes):
    """``cp.async.cg.shared.global``: 16 bytes from element ``src_elem`` (non-negative) of the global
    array ``src`` (its last axes dense, 16-byte aligned) to byte ``dst_byte`` of the shared array ``dst``;
    ``src_bytes`` of them read, the rest zero (0: a row past the end, whose address may lie past the
    array: ptxas makes the copy its ignore-src form, which reads nothing).  Lands at ``cp_async_wait``."""
    sig = signature(
        types.void, dst, types.unliteral(dst_byte), src, types.unliteral(src_elem), types.unliteral(src_bytes)
    )

    def codegen(context, builder, sig, args):
        at = _shared_address(context, builder, sig.args[0], args[0], _uint32(context, builder, args[1], sig.args[1]))
        data = context.make_array(sig.args[2])(context, builder, args[2]).data
        # a signed 64-bit offset: a constant added to it folds into the instruction's address
        offset = context.cast(builder, args[3], sig.args[3], types.int64)
        source = builder.ptrtoint(builder.gep(data, [offset]), ir.IntType(64))
        size = _uint32(context, builder, args[4], sig.args[4])
        fnty = ir.FunctionType(ir.VoidType(), [_I32, ir.IntType(64), _I32])
        call_asm(builder, fnty, "cp.async.cg.shared.global [$0], [$1], 16, $2;", "r,l,r", [at, source, size])
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def cp_async_commit(typingctx):
    """``cp.async.commit_group``: this thread's copies issued since the last commit become a group."""
    sig = signature(types.void)

    def codegen(context, builder, sig, args):
        call_asm(builder, ir.FunctionType(ir.VoidType(), []), "cp.async.commit_group;", "", [])
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def cp_async_wait(typingctx, pending):
    """``cp.async.wait_group pending``: wait until at most ``pending`` (a constant) of this thread's
    groups are in flight; the rest have landed (seen by other threads after a barrier)."""
    if not isinstance(pending, types.IntegerLiteral):
        return None
    sig = signature(types.void, pending)
    text = f"cp.async.wait_group {pending.literal_value};"

    def codegen(context, builder, sig, args):
        call_asm(builder, ir.FunctionType(ir.VoidType(), []), text, "", [])
        return context.get_dummy_value()

    return sig, codegen


def _ldmatrix(atom):
    """``ldmatrix`` of ``atom`` (``atoms.LdMatrix``): this lane's registers of four 8 x 8 matrices,
    the lane giving the address (byte ``byte`` of the shared array ``sh``) of its row."""
    registers = ", ".join(f"${k}" for k in range(atom.count))
    text = f"{atom.name} {{{registers}}}, [${atom.count}];"
    constraints = ",".join(["=r"] * atom.count + ["r"])

    @intrinsic
    def ldmatrix(typingctx, sh, byte):
        sig = signature(types.UniTuple(types.uint32, atom.count), sh, types.unliteral(byte))

        def codegen(context, builder, sig, args):
            at = _shared_address(
                context, builder, sig.args[0], args[0], _uint32(context, builder, args[1], sig.args[1])
            )
            fnty = ir.FunctionType(ir.LiteralStructType([_I32] * atom.count), [_I32])
            result = call_asm(builder, fnty, text, constraints, [at])
            parts = [builder.extract_value(result, k) for k in range(atom.count)]
            return context.make_tuple(builder, sig.return_type, parts)

        return sig, codegen

    return ldmatrix


ldmatrix_x4 = _ldmatrix(LDMATRIX_X4)
ldmatrix_x4_trans = _ldmatrix(LDMATRIX_X4_TRANS)


def _word_pointer(context, builder, array_type, array, index, index_type):
    """The 32-bit word at element ``index`` (even, a uint32) of a dense array of 16-bit elements."""
    data = context.make_array(array_type)(context, builder, array).data
    at = builder.gep(data, [builder.zext(_uint32(context, builder, index, index_type), ir.IntType(64))])
    return builder.bitcast(at, ir.PointerType(_I32))


@intrinsic
def load_pair16(typingctx, array, index):
    """Elements ``index`` and ``index + 1`` (``index`` even) of a dense 16-bit array as one register,
    the first in the low half: one 32-bit load."""
    sig = signature(types.uint32, array, types.unliteral(index))

    def codegen(context, builder, sig, args):
        return builder.load(_word_pointer(context, builder, sig.args[0], args[0], args[1], sig.args[1]), align=4)

    return sig, codegen


@intrinsic
def store_pair16(typingctx, array, index, word):
    """A register's two 16-bit halves into elements ``index`` and ``index + 1`` (``index`` even) of a
    dense 16-bit array, the low half first: one 32-bit store."""
    sig = signature(types.void, array, types.unliteral(index), types.uint32)

    def codegen(context, builder, sig, args):
        builder.store(args[2], _word_pointer(context, builder, sig.args[0], args[0], args[1], sig.args[1]), align=4)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def red_add_f32(typingctx, array, index, value):
    """``red.global.add.f32``: ``value`` added to element ``index`` (non-negative) of a dense float32
    array (flat), atomically, nothing returned (an atomic add whose old value nobody reads).  The
    index is a signed 64-bit offset: a constant added to it folds into the instruction's address."""
    sig = signature(types.void, array, types.unliteral(index), types.float32)

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        at = builder.gep(data, [context.cast(builder, args[1], sig.args[1], types.int64)])
        fnty = ir.FunctionType(ir.VoidType(), [ir.IntType(64), _F32])
        call_asm(builder, fnty, "red.global.add.f32 [$0], $1;", "l,f", [builder.ptrtoint(at, ir.IntType(64)), args[2]])
        return context.get_dummy_value()

    return sig, codegen
