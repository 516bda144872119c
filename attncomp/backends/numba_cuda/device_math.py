"""Math with the IR's meaning at the edges, for generated kernels.

On the GPU ``math.log(0.0)`` is ``-inf`` and ``math.sqrt(-1.0)`` is NaN, as
the IR says; under Numba's CUDA simulator the same calls run in Python's
``math``, which raises.  These device functions decide the edge cases
themselves, so a kernel means the same in both places (a compare and a
select on the GPU).  They are inlined into the calling kernel by Numba
(``inline="always"``): a separately compiled device function would need a
GPU to learn its target, and kernels must compile to PTX without one.

``select(c, a, b)`` is the kernels' choice between two computed values without a branch: an LLVM
``select`` on the GPU, a conditional expression in the simulator.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda

from attncomp.backends.numba_cuda.warp import SIMULATED, exp2_approx, log2_approx, rcp_approx
from attncomp.ir.ops import random as counters

#: op name -> helper, for ``ScalarEmitter(functions=...)``
FUNCTIONS = {
    "ac.exp": "ac_exp",
    "ac.log": "ac_log",
    "ac.sqrt": "ac_sqrt",
    "ac.rsqrt": "ac_rsqrt",
    "ac.sin": "ac_sin",
    "ac.cos": "ac_cos",
}
#: the attention kernels' (``CudaKernelSource``): a score function's float32 exp, log and division by
#: the special function unit (``ex2.approx``, ``lg2.approx``, ``rcp.approx``: a few instructions
#: where libdevice's accurate ``expf`` and ``logf`` are tens and an IEEE division some twenty with a
#: slow-path call, per score element; sigmoid attention's ``log sigmoid`` and its gradient call
#: each); graph kernels keep the accurate ones
TILE_FUNCTIONS = {
    **FUNCTIONS,
    ("ac.exp", "f32"): "fast_exp",
    ("ac.log", "f32"): "fast_log",
    ("ac.div", "f32"): "fast_div",
}
#: the name of the kernels' choice between computed values (``codegen.choose``), defined below
SELECT = "select"
#: ``ac.random``'s hash, as the scalar code calls it (``codegen.ScalarEmitter``), defined below
RANDOM = ("random_step", "random_unit")
#: a generated kernel's import of these, of ``select`` and of the hash
NAMES = ", ".join(sorted([*set(TILE_FUNCTIONS.values()), SELECT, *RANDOM]))
IMPORT = f"from attncomp.backends.numba_cuda.device_math import {NAMES}"


@cuda.jit(device=True, inline="always")
def ac_exp(x):
    if x > 709.0:  # past float64's range: Python raises OverflowError
        return math.inf
    return math.exp(x)


@cuda.jit(device=True, inline="always")
def ac_log(x):
    if x > 0:
        return math.log(x)
    if x == 0:
        return -math.inf
    return math.nan


@cuda.jit(device=True, inline="always")
def fast_exp(x):
    """``e**x`` in float32 by ``ex2.approx`` of ``x log2 e``: within a few units in the last place and
    the input's own conditioning (|x| 2**-24 relative); infinite past 88.7, 0 below -87.3 (flushed, as
    the softmax's exponentials are); NaN stays NaN."""
    return exp2_approx(x * np.float32(1.4426950408889634))


@cuda.jit(device=True, inline="always")
def fast_log(x):
    """The natural logarithm in float32 by ``lg2.approx``, times ln 2: 0 gives -inf, a negative NaN."""
    return log2_approx(x) * np.float32(0.6931471805599453)


@cuda.jit(device=True, inline="always")
def fast_div(x, y):
    """``x / y`` in float32 as ``x`` times ``rcp.approx`` of ``y``: within two units in the last place
    for |y| under 2^126 (past it the reciprocal is flushed to 0); ``x / 0`` infinite (0 / 0 NaN),
    ``x / inf`` 0, as an IEEE division gives them."""
    return x * rcp_approx(y)


@cuda.jit(device=True, inline="always")
def ac_sqrt(x):
    if x >= 0:
        return math.sqrt(x)
    return math.nan


@cuda.jit(device=True, inline="always")
def ac_rsqrt(x):
    if x > 0:
        return 1.0 / math.sqrt(x)
    if x == 0:
        return math.inf
    return math.nan


@cuda.jit(device=True, inline="always")
def ac_sin(x):
    if math.isinf(x):
        return math.nan
    return math.sin(x)


@cuda.jit(device=True, inline="always")
def ac_cos(x):
    if math.isinf(x):
        return math.nan
    return math.cos(x)


if SIMULATED:

    def random_step(x, counter):
        """``counters.step``, the one definition, with NumPy's 64-bit scalar overflow (the wrapping the
        hash means to have, as the GPU's) not warned of."""
        with np.errstate(over="ignore"):
            return counters.step(x, counter)

    def random_unit(x, counter):
        """``counters.unit``, as :func:`random_step`."""
        with np.errstate(over="ignore"):
            return counters.unit(x, counter)

    def select(c, a, b):
        """``a`` where ``c`` holds, else ``b`` (as the GPU's below)."""
        return a if c else b

else:
    random_step = cuda.jit(device=True, inline="always")(counters.step)
    random_unit = cuda.jit(device=True, inline="always")(counters.unit)

    from numba.cuda import types
    from numba.cuda.extending import intrinsic
    from numba.cuda.typing import signature

    @intrinsic
    def select(typingctx, c, a, b):
        """``a`` where ``c`` holds, else ``b``: both already computed, one LLVM ``select`` (``selp``).

        The kernels' choices between values (a mask, a bound, a copy's size): a conditional
        expression would be a branch and a join in Numba's IR, whose front end spends time per block
        and per variable assigned more than once; written so, a tensor-core kernel's few hundred
        choices took most of its compile.  LLVM made selects of them anyway: the SASS is the same."""
        result = typingctx.unify_types(types.unliteral(a), types.unliteral(b))
        if result is None:
            return None
        sig = signature(result, types.boolean, types.unliteral(a), types.unliteral(b))

        def codegen(context, builder, sig, args):
            cond = context.cast(builder, args[0], c, types.boolean)
            x = context.cast(builder, args[1], sig.args[1], result)
            y = context.cast(builder, args[2], sig.args[2], result)
            return builder.select(cond, x, y)

        return sig, codegen
