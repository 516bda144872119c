"""Appending to an 8-bit cache on the CPU: new rows quantised in compiled code, in place.

``append_rows(cache, scales, new, length, top, fraction_bits, bias, nan_code)`` writes each new row
(one token of one head: ``new[p, t]``) as codes at ``cache[p, length + t]`` and its scale at
``scales[p, length + t]``, with the arithmetic of ``ir.quantized.quantize``: ``scale = amax / MAX``
(NaN where the row holds a NaN), the entries divided by the scale (by 1 where it is not positive: a
row of zeros), saturated to ``[-MAX, MAX]`` (NaN kept), and rounded to nearest even by
``fp8_bits.encoder``, the GPU's arithmetic too.  A decode step's append of one token is a few
microseconds, where NumPy's ten small array operations took about fifteen.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from attncomp.backends.fp8_bits import encoder
from attncomp.backends.numba_cpu.vector_loops import f32_bits

_encode = encoder(njit(inline="always"))


@njit(cache=True, nogil=True)
def append_rows(cache, scales, new, length, top, fraction_bits, bias, nan_code):
    """See the module: ``cache`` ``[P, N, d]`` codes (uint8), ``scales`` ``[P, N]`` float32, ``new``
    ``[P, T, d]`` float32."""
    for p in range(new.shape[0]):
        for t in range(new.shape[1]):
            row = new[p, t]
            amax = np.float32(0.0)
            nan = False
            for e in range(row.shape[0]):
                a = abs(row[e])
                if a != a:
                    nan = True
                elif a > amax:
                    amax = a
            scale = np.float32(np.nan) if nan else np.float32(amax / top)
            divisor = scale if scale > np.float32(0.0) else np.float32(1.0)
            for e in range(row.shape[0]):
                x = np.float32(row[e] / divisor)
                if x == x:  # saturating: rounding never leaves the range
                    x = min(max(x, -top), top)
                cache[p, length + t, e] = np.uint8(_encode(np.int64(f32_bits(x)), fraction_bits, bias, nan_code))
            scales[p, length + t] = scale
