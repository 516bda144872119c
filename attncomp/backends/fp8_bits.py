"""Float32 values as 8-bit float codes by integer arithmetic on their bits, for every compiler.

``encoder(jit)`` gives ``encode(bits, fraction_bits, bias, nan_code)`` compiled by ``jit``
(``numba.njit`` for the CPU, ``numba.cuda.jit(device=True)`` for the GPU): the code of the float32
whose bits are ``bits``, already saturated to the type's range (``ir.quantized.quantize`` clips
before it converts), rounded to nearest, ties to even, as ``ml_dtypes`` converts; NaN as the type's
NaN code ``nan_code`` with ``x``'s sign.  A normal result rounds float32's exponent and fraction
together (a carry moves into the exponent); a subnormal one rounds its fraction in steps of the
type's smallest subnormal.  ``f8e4m3`` is ``(3, 7, 0x7F)``, ``f8e5m2`` ``(2, 15, 0x7E)``
(``FORMATS``).
"""

from __future__ import annotations

from collections.abc import Callable

#: each 8-bit type's (fraction bits, exponent bias, NaN code)
FORMATS = {"f8e4m3": (3, 7, 0x7F), "f8e5m2": (2, 15, 0x7E)}


def encoder(jit: Callable) -> Callable:
    """``encode(bits, fraction_bits, bias, nan_code)`` compiled by ``jit`` (see the module)."""

    @jit
    def round_shift(m, s):
        """``m >> s`` rounded to nearest, ties to even (``m < 2**24``, ``s >= 1``)."""
        if s > 24:
            return 0
        q = m >> s
        rest = m - (q << s)
        half = 1 << (s - 1)
        if rest > half or (rest == half and (q & 1) == 1):
            q += 1
        return q

    @jit
    def encode(bits, fraction_bits, bias, nan_code):
        sign = (bits >> 24) & 0x80
        magnitude = bits & 0x7FFFFFFF
        if magnitude > 0x7F800000:
            return sign | nan_code
        exponent = magnitude >> 23
        if exponent >= 128 - bias:  # normal in the 8-bit type
            code = round_shift(magnitude, 23 - fraction_bits) - ((127 - bias) << fraction_bits)
        else:
            fraction = magnitude & 0x7FFFFF
            if exponent > 0:
                fraction = fraction | 0x800000
            shift = 150 - (bias - 1 + fraction_bits) - max(exponent, 1)
            code = round_shift(fraction, shift)
        return sign | code

    return encode
