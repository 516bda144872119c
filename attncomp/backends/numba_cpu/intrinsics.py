"""LLVM operations the generated CPU kernels need and Numba's Python builtins do not give.

``maximum_f32``/``maximum_f64`` are ``llvm.maximum``: IEEE 754-2019 maximum, which
returns NaN when either operand is NaN (as PyTorch's max does).  LLVM vectorises a
row's max reduction written with it; Numba's ``max`` builtin keeps a scalar
compare-and-branch chain (a 3x slower score pass).  ``float_from_bits`` is a
bit cast, so that ``exp`` can build ``2**n`` from its exponent bits.
"""

from __future__ import annotations

from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic


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
