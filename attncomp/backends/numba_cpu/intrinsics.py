"""LLVM operations the generated CPU kernels need and Numba's Python builtins do not give.

``maximum_f32``/``maximum_f64`` are ``llvm.maximum``: IEEE 754-2019 maximum, which
returns NaN when either operand is NaN (as PyTorch's max does).  LLVM vectorises a
row's max reduction written with it; Numba's ``max`` builtin keeps a scalar
compare-and-branch chain (a 3x slower score pass).  ``float_from_bits`` is a
bit cast, so that ``exp`` can build ``2**n`` from its exponent bits.  ``gemm`` is
BLAS's matrix product with its transposes, leading dimensions and ``beta``, which
``np.dot`` hides: it multiplies tiles in place and accumulates without a temporary.
``pin_blas_threads``/``restore_blas_threads`` keep that BLAS to one thread while a kernel runs;
``take_ticket`` hands a parallel launch's workers their tasks one at a time.
"""

from __future__ import annotations

import ctypes
import glob
import os
from typing import Any

from llvmlite import binding as llvm
from llvmlite import ir
from numba.core import cgutils, types
from numba.core.errors import TypingError
from numba.core.typing.templates import Signature
from numba.extending import get_cython_function_address, intrinsic


def _maximum(numba_type: types.Float, llvm_type: ir.Type):
    @intrinsic
    def maximum(typingctx, a, b):
        def codegen(context, builder, signature, args):
            fnty = ir.FunctionType(llvm_type, [llvm_type, llvm_type])
            fn = builder.module.declare_intrinsic("llvm.maximum", [llvm_type], fnty)
            return builder.call(fn, args)

        return numba_type(numba_type, numba_type), codegen

    return maximum


maximum_f32 = _maximum(types.float32, ir.FloatType())
maximum_f64 = _maximum(types.float64, ir.DoubleType())


@intrinsic
def float_from_bits(typingctx, bits):
    """The float32 whose bits are the int32 ``bits``."""

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.int32), codegen


@intrinsic
def bf16_to_f32(typingctx, bits):
    """The float32 a bf16 is, from its 16 bits (a uint16): the bits, shifted to the top of a float32."""

    def codegen(context, builder, signature, args):
        wide = builder.shl(builder.zext(args[0], ir.IntType(32)), ir.Constant(ir.IntType(32), 16))
        return builder.bitcast(wide, ir.FloatType())

    return types.float32(types.uint16), codegen


@intrinsic
def take_ticket(typingctx, tickets):
    """The next number of the counter ``tickets[0]`` (an int64 array), counted up by one atomically:
    the workers of a parallel launch take their tasks by it, each the next one free when it is
    done with the last, rather than every n-th (a causal mask's query blocks differ in work)."""
    if not isinstance(tickets, types.Array) or tickets.dtype != types.int64 or tickets.ndim != 1:
        raise TypingError(f"take_ticket takes a one-dimensional int64 array, not {tickets}")

    def codegen(context, builder, signature, args):
        array = context.make_array(tickets)(context, builder, args[0])
        one = ir.Constant(ir.IntType(64), 1)
        return builder.atomic_rmw("add", array.data, one, "monotonic")

    return types.int64(tickets), codegen


@intrinsic
def prefer_wide_vectors(typingctx):
    """Let LLVM vectorise the calling function with the CPU's widest vectors (512-bit with
    AVX-512; x86 targets otherwise prefer 256).  The online softmax's exp2 pass calls it: with
    zmm registers a dense or causal forward runs 5 to 7% faster on an AVX-512 Xeon.  A string
    attribute, which llvmlite's attribute set does not list, so it is added to the set as is;
    targets without such vectors ignore it."""

    def codegen(context, builder, signature, args):
        set.add(builder.function.attributes, '"prefer-vector-width"="512"')
        return context.get_dummy_value()

    return types.void(), codegen


# BLAS gemm ------------------------------------------------------------------------------
# SciPy's Fortran ``sgemm``/``dgemm`` under names of our own: generated kernels call them by
# name, so their compiled code holds no process address and stays cacheable on disk.
for _kind in "sd":
    llvm.add_symbol(f"attncomp_{_kind}gemm", get_cython_function_address("scipy.linalg.cython_blas", f"{_kind}gemm"))


def _gemm_codegen(dtype: types.Float):
    def codegen(context, builder, signature, args):
        trans_a, trans_b, m, n, k, a, b, beta, c = args
        real = context.get_value_type(dtype)
        i32, char = ir.IntType(32), ir.IntType(8)
        # transa, transb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc: all by reference
        params = (char, char, i32, i32, i32, real, real, i32, real, i32, real, real, i32)
        fnty = ir.FunctionType(ir.VoidType(), [ir.PointerType(t) for t in params])
        fn = cgutils.get_or_insert_function(
            builder.module, fnty, f"attncomp_{'s' if dtype == types.float32 else 'd'}gemm"
        )
        itemsize = context.get_abi_sizeof(real)

        def slot(value):
            return cgutils.alloca_once_value(builder, value)

        def int_slot(value):
            return slot(builder.sext(value, i32) if value.type.width < 32 else builder.trunc(value, i32))

        def matrix(ty, value):
            """The data pointer and the leading dimension (row stride in elements, at least 1)."""
            array = context.make_array(ty)(context, builder, value)
            rows = builder.sdiv(cgutils.unpack_tuple(builder, array.strides)[0], ir.Constant(cgutils.intp_t, itemsize))
            one = ir.Constant(cgutils.intp_t, 1)
            return array.data, int_slot(builder.select(builder.icmp_signed("<", rows, one), one, rows))

        def flag(trans):
            transposed = builder.icmp_signed("!=", trans, ir.Constant(trans.type, 0))
            return slot(builder.select(transposed, ir.Constant(char, ord("t")), ir.Constant(char, ord("n"))))

        a_data, lda = matrix(signature.args[5], a)
        b_data, ldb = matrix(signature.args[6], b)
        c_data, ldc = matrix(signature.args[8], c)
        alpha = slot(ir.Constant(real, 1.0))
        beta = slot(context.cast(builder, beta, signature.args[7], dtype))
        # Fortran is column-major: a row-major c = op(a) op(b) is the column-major cᵀ = op(b)ᵀ op(a)ᵀ
        m, n, k = (int_slot(x) for x in (m, n, k))
        builder.call(fn, [flag(trans_b), flag(trans_a), n, m, k, alpha, b_data, ldb, a_data, lda, beta, c_data, ldc])
        return context.get_dummy_value()

    return codegen


@intrinsic
def gemm(typingctx, trans_a, trans_b, m, n, k, a, b, beta, c):
    """``c[:m, :n] = op(a) @ op(b) + beta * c[:m, :n]`` by BLAS (``beta = 1`` accumulates).

    ``op(a)`` is the ``m x k`` matrix ``a[:m, :k]``, or ``a[:k, :m].T`` when ``trans_a`` is
    nonzero; ``op(b)``, ``k x n``, likewise.  The arrays are 2-d and of one float type, ``c``
    C-contiguous, ``a`` and ``b`` C-contiguous or of any layout whose rows are contiguous (each
    row's elements one after another, the rows any stride apart: a key tile's rows of a
    ``[B, S, H, D]`` array, which the kernels pass; the leading dimension is the rows' stride);
    the products read and write the tiles' rows in place (submatrices of larger buffers
    included), with no copies and no temporaries.
    """
    arrays = (a, b, c)
    if not all(isinstance(x, types.Array) and x.ndim == 2 and x.layout in "CA" for x in arrays) or c.layout != "C":
        return None
    if a.dtype not in (types.float32, types.float64) or not a.dtype == b.dtype == c.dtype:
        return None
    if not all(isinstance(x, types.Integer) for x in (trans_a, trans_b, m, n, k)):
        return None
    if not isinstance(beta, (types.Integer, types.Float)):
        return None
    return types.void(trans_a, trans_b, m, n, k, a, b, beta, c), _gemm_codegen(a.dtype)


# BLAS threads ----------------------------------------------------------------------------
# Kernels call BLAS from every worker of their ``prange``; a BLAS that also starts threads
# oversubscribes the cores (measured: 10x slower tiles).  A kernel's parallel driver sets SciPy's
# OpenBLAS to one thread as it starts and back as it ends: two calls in compiled code, where a
# Python ``with`` around the kernel cost three ctypes calls (1.5 us) per kernel call.  A task
# that raises (Numba's MemoryError) skips the second: the pin leaves the count it found in
# ``attncomp_blas_pinned_from`` (the restore sets it back to 1), and the caller's error path
# (:func:`unpin_after_error`) restores that count.
def scipy_openblas() -> Any:
    """SciPy's OpenBLAS library (ctypes), or None where it is not found."""
    try:
        import scipy

        pattern = os.path.join(os.path.dirname(scipy.__file__), "..", "scipy.libs", "libscipy_openblas*")
        for path in glob.glob(pattern):
            lib = ctypes.CDLL(path)
            if hasattr(lib, "scipy_openblas_set_num_threads"):
                return lib
    except Exception:  # an optional speed-up: never fail for it
        return None
    return None


_BLAS = scipy_openblas()


def blas_kernels() -> str | None:
    """OpenBLAS's name for the kernels SciPy's OpenBLAS runs on this CPU (its own choice, or
    ``OPENBLAS_CORETYPE``'s): "Haswell", "SkylakeX", ...; None where SciPy's BLAS is not OpenBLAS.
    The cpu backend's tiles are chosen by it (``passes.manager.CPU_TILES``), and the way they hold
    their scores (``score_layout``)."""
    corename = getattr(_BLAS, "scipy_openblas_get_corename", None)
    if corename is None:
        return None
    corename.restype = ctypes.c_char_p
    return corename().decode()


#: without SciPy's OpenBLAS, functions that report one thread and set nothing (ctypes callbacks:
#: kept here, alive, as long as the kernels that call them)
_NO_BLAS = (ctypes.CFUNCTYPE(ctypes.c_int)(lambda: 1), ctypes.CFUNCTYPE(None, ctypes.c_int)(lambda n: None))
for _name, _found, _fallback in (
    ("attncomp_blas_threads", "scipy_openblas_get_num_threads", _NO_BLAS[0]),
    ("attncomp_set_blas_threads", "scipy_openblas_set_num_threads", _NO_BLAS[1]),
):
    _function = getattr(_BLAS, _found) if _BLAS is not None else _fallback
    llvm.add_symbol(_name, ctypes.cast(_function, ctypes.c_void_p).value)


#: the count the last pin found, while a kernel holds it (1 otherwise): written by the kernels
_PINNED_FROM = ctypes.c_int32(1)
llvm.add_symbol("attncomp_blas_pinned_from", ctypes.addressof(_PINNED_FROM))


def _pinned_from(builder: ir.IRBuilder) -> ir.Value:
    """The ``attncomp_blas_pinned_from`` global (an ``i32*``), declared in the kernel's module."""
    try:
        return builder.module.get_global("attncomp_blas_pinned_from")
    except KeyError:
        variable = ir.GlobalVariable(builder.module, ir.IntType(32), "attncomp_blas_pinned_from")
        variable.linkage = "external"
        return variable


def unpin_after_error() -> None:
    """Set SciPy's OpenBLAS back to the count a kernel's pin found, where the kernel raised before
    restoring it (what the CPU functions' calls do on an error)."""
    if _BLAS is not None and _PINNED_FROM.value != 1:
        _BLAS.scipy_openblas_set_num_threads(_PINNED_FROM.value)
        _PINNED_FROM.value = 1


def _blas_threads(builder: ir.IRBuilder, value: ir.Value | None = None) -> ir.Value:
    """A call of the BLAS's thread count (``value`` None) or of its setter (to ``value``)."""
    i32 = ir.IntType(32)
    if value is None:
        fnty, name, args = ir.FunctionType(i32, []), "attncomp_blas_threads", []
    else:
        fnty, name, args = ir.FunctionType(ir.VoidType(), [i32]), "attncomp_set_blas_threads", [value]
    return builder.call(cgutils.get_or_insert_function(builder.module, fnty, name), args)


@intrinsic
def pin_blas_threads(typingctx):
    """Set SciPy's OpenBLAS to one thread; give the count it had (for :func:`restore_blas_threads`)."""

    def codegen(context, builder, signature, args):
        saved = _blas_threads(builder)
        one = ir.Constant(saved.type, 1)
        with builder.if_then(builder.icmp_signed("!=", saved, one)):
            _blas_threads(builder, one)
            builder.store(saved, _pinned_from(builder))
        return builder.sext(saved, ir.IntType(64))

    return types.int64(), codegen


@intrinsic
def restore_blas_threads(typingctx, saved):
    """Set SciPy's OpenBLAS back to ``saved`` threads (what :func:`pin_blas_threads` gave)."""
    if not isinstance(saved, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        count = builder.trunc(args[0], ir.IntType(32)) if args[0].type.width > 32 else args[0]
        with builder.if_then(builder.icmp_signed("!=", count, ir.Constant(count.type, 1))):
            _blas_threads(builder, count)
            builder.store(ir.Constant(ir.IntType(32), 1), _pinned_from(builder))
        return context.get_dummy_value()

    return types.void(saved), codegen


# Calling a task through its address --------------------------------------------------------
def task_caller(signature: Signature):
    """An intrinsic ``call(address, *args)`` calling the compiled function of ``signature`` found
    at ``address`` (its entry point in Numba's calling convention; ``runtime.task_addresses``).

    A parallel driver calls its tasks this way rather than by name, so their code is not linked
    into the driver and optimised a second time (which costs as much as compiling them).  The
    arguments must have exactly the signature's types: anything else is a typing error.
    """

    @intrinsic
    def call(typingctx, address, *args):
        if len(args) == 1 and isinstance(args[0], types.StarArgTuple):
            args = tuple(args[0].types)
        if not isinstance(address, types.Integer) or tuple(args) != tuple(signature.args):
            raise TypingError(f"a task of signature {signature} called with {tuple(args)}")

        def codegen(context, builder, sig, llargs):
            argtys = signature.args
            values = cgutils.unpack_tuple(builder, llargs[1], len(argtys))
            fnty = context.call_conv.get_function_type(signature.return_type, argtys)
            target = builder.inttoptr(llargs[0], fnty.as_pointer())
            status, _ = context.call_conv.call_function(builder, target, signature.return_type, argtys, values)
            with cgutils.if_unlikely(builder, status.is_error):
                context.call_conv.return_status_propagate(builder, status)
            return context.get_dummy_value()

        return types.void(address, types.StarArgTuple.from_types(args)), codegen

    return call
