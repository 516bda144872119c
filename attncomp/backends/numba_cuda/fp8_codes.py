"""8-bit float codes on the device: decoding to float32 and encoding, by integer arithmetic on bits.

A decoder's 8-bit cache (``ir.quantized``) holds ``f8e4m3`` (``float8_e4m3fn``: 4 exponent bits of
bias 7, 3 fraction bits, no infinities, ``S.1111.111`` NaN) or ``f8e5m2`` (``float8_e5m2``: 5 of bias
15, 2 fraction bits, IEEE infinities and NaNs) codes as bytes (uint8: the array interface has no
8-bit floats).  These device functions give the same values ``ml_dtypes`` does:

- ``decode_f8e4m3(code)``, ``decode_f8e5m2(code)``: the float32 a code is (exact; NaN as float32's
  quiet NaN of the code's sign).  A normal code's exponent and fraction move into float32's fields;
  a subnormal one is its fraction times the smallest step.
- ``encode_f8e4m3(x)``, ``encode_f8e5m2(x)``: the code of a float32 already saturated to the type's
  range (``quantize`` clips before it converts), rounded to nearest, ties to even; NaN as the type's
  NaN of ``x``'s sign (``0x7F`` / ``0x7E``, ``ml_dtypes``'s).

Inlined into the calling kernels (``inline="always"``), the same code in the simulator and on the GPU
(``warp.f32_bits``, ``warp.bits_f32``), so that kernels compile to PTX without a GPU.
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from attncomp.backends.fp8_bits import encoder
from attncomp.backends.numba_cuda.warp import bits_f32, f32_bits
from attncomp.ir.core import Op, Value

#: float32's quiet NaN, positive and negative
_NAN, _NEG_NAN = 0x7FC00000, 0xFFC00000


@cuda.jit(device=True, inline="always")
def _decode(code, fraction_bits, rebias, step):
    """A finite code with ``fraction_bits``: float32 bits for a normal one (exponent + ``rebias``),
    ``fraction * step`` for a subnormal one, signed."""
    c = int(code)
    negative = c >= 128
    exponent = (c & 0x7F) >> fraction_bits
    fraction = c & ((1 << fraction_bits) - 1)
    if exponent == 0:
        value = np.float32(fraction) * np.float32(step)
        return -value if negative else value
    bits = ((exponent + rebias) << 23) | (fraction << (23 - fraction_bits))
    if negative:
        bits = bits | 0x80000000
    return bits_f32(np.uint32(bits))


@cuda.jit(device=True, inline="always")
def decode_f8e4m3(code):
    c = int(code)
    if (c & 0x7F) == 0x7F:
        return bits_f32(np.uint32(_NEG_NAN if c >= 128 else _NAN))
    return _decode(c, 3, 120, 2.0**-9)


@cuda.jit(device=True, inline="always")
def decode_f8e5m2(code):
    c = int(code)
    if (c & 0x7C) == 0x7C:  # all exponent bits: infinity (fraction 0) or NaN
        if (c & 3) == 0:
            return bits_f32(np.uint32(0xFF800000 if c >= 128 else 0x7F800000))
        return bits_f32(np.uint32(_NEG_NAN if c >= 128 else _NAN))
    return _decode(c, 2, 112, 2.0**-16)


#: ``fp8_bits.encoder``'s arithmetic, shared with the CPU's appends
_encode_bits = encoder(cuda.jit(device=True, inline="always"))


@cuda.jit(device=True, inline="always")
def _encode(x, fraction_bits, bias, nan_code):
    """The code of a float32 within the type's range (``fp8_bits.encoder``)."""
    return np.uint8(_encode_bits(int(f32_bits(np.float32(x))), fraction_bits, bias, nan_code))


@cuda.jit(device=True, inline="always")
def encode_f8e4m3(x):
    return _encode(x, 3, 7, 0x7F)


@cuda.jit(device=True, inline="always")
def encode_f8e5m2(x):
    return _encode(x, 2, 15, 0x7E)


#: the cache type -> (its decoder, its encoder), as the generated kernels name them
DECODE = {"f8e4m3": "decode_f8e4m3", "f8e5m2": "decode_f8e5m2"}
ENCODE = {"f8e4m3": "encode_f8e4m3", "f8e5m2": "encode_f8e5m2"}
#: the import line of a generated kernel
IMPORT = "from attncomp.backends.numba_cuda.fp8_codes import decode_f8e4m3, decode_f8e5m2, encode_f8e4m3, encode_f8e5m2"


def quantized_append(value: Value) -> Op | None:
    """The ``ac.cache_append`` to an 8-bit cache (cache, scales, new entries) that ``value`` is, if
    any: a tile source whose rows are codes, each read with its row's scale."""
    owner = value.owner
    if getattr(owner, "name", None) == "ac.cache_append" and len(owner.operands) == 3:
        return owner
    return None


def quantized_pages(value: Value) -> Op | None:
    """The ``ac.page_view`` of 8-bit pages (pages, table, scales) that ``value`` is, if any: a tile
    source read through the table, each row's codes with its scale (``[page, *heads, slot]``)."""
    owner = value.owner
    if getattr(owner, "name", None) == "ac.page_view" and len(owner.operands) == 3:
        return owner
    return None


def codes_of(value: Value) -> str | None:
    """The 8-bit type of a tile source read as codes (an 8-bit cache or 8-bit pages), else None."""
    owner = quantized_append(value) or quantized_pages(value)
    return None if owner is None else owner.operands[0].type.dtype
