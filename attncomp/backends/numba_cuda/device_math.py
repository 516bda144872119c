"""Math with the IR's meaning at the edges, for generated kernels.

On the GPU ``math.log(0.0)`` is ``-inf`` and ``math.sqrt(-1.0)`` is NaN, as
the IR says; under Numba's CUDA simulator the same calls run in Python's
``math``, which raises.  These device functions decide the edge cases
themselves, so a kernel means the same in both places (a compare and a
select on the GPU).  They are inlined into the calling kernel by Numba
(``inline="always"``): a separately compiled device function would need a
GPU to learn its target, and kernels must compile to PTX without one.
"""

from __future__ import annotations

import math

from numba import cuda

#: op name -> helper, for ``ScalarEmitter(functions=...)``
FUNCTIONS = {
    "ac.exp": "ac_exp",
    "ac.log": "ac_log",
    "ac.sqrt": "ac_sqrt",
    "ac.rsqrt": "ac_rsqrt",
    "ac.sin": "ac_sin",
    "ac.cos": "ac_cos",
}
IMPORT = f"from attncomp.backends.numba_cuda.device_math import {', '.join(sorted(FUNCTIONS.values()))}"


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
