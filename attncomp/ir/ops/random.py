"""``ac.random``: a uniform number in [0, 1) that is a function of integer counters.

    %u = ac.random %seed, %b, %h, %i, %j : tensor<1 x 1 x T x S x f32>

The counters (integer tensors, broadcast together) are hashed one at a time.  All but the last
go through SplitMix64's mixing function (``x = 0``, then ``x = mix64(x + (c + 1) * golden)``); the
last, which varies fastest in the kernels (a key position), is added the same way,
``z = x + (c + 1) * golden``, and the two halves of ``z`` are xor-ed and mixed by MurmurHash3's
32-bit finaliser: a few 32-bit operations an element, where the rest of the state (the seed, the
batch, head and query position) is the same along a row.  The result is the top 24 bits of that
word times ``2**-24``: a float32 in ``[0, 1 - 2**-24]``, every value a multiple of ``2**-24``.
Nothing is stored between calls: the same counters give the same number in the reference
interpreter, on the CPU and on the GPU, so attention dropout (``ac.dropout``) draws its mask in
the forward and draws it again, equal bit for bit, in the backward.

:func:`step` and :func:`unit` are written once for NumPy and for Numba: the interpreter runs
them on arrays of ``uint64``, the generated kernels compile them (``njit``, ``cuda.jit``).
"""

from __future__ import annotations

import numpy as np

from attncomp.errors import TypeCheckError
from attncomp.ir.ops.base import register
from attncomp.ir.ops.elementwise import Elementwise
from attncomp.ir.types import TensorType

#: SplitMix64's increment (2**64 / the golden ratio) and the two multipliers of its mixing function
GOLDEN = np.uint64(0x9E3779B97F4A7C15)
MIX_1 = np.uint64(0xBF58476D1CE4E5B9)
MIX_2 = np.uint64(0x94D049BB133111EB)
#: MurmurHash3's 32-bit finaliser's multipliers
FMIX_1 = np.uint64(0x85EBCA6B)
FMIX_2 = np.uint64(0xC2B2AE35)
ONE, LOW = np.uint64(1), np.uint64(0xFFFFFFFF)
SHIFT_1, SHIFT_2, SHIFT_3 = np.uint64(30), np.uint64(27), np.uint64(31)
HALF, SIXTEEN, THIRTEEN, EIGHT = np.uint64(32), np.uint64(16), np.uint64(13), np.uint64(8)
#: 2**-24: the unit of the numbers drawn
UNIT = np.float32(1.0 / (1 << 24))


def step(x, counter):
    """The state after hashing in a counter that is not the last (both taken as ``uint64``: a
    negative counter wraps): SplitMix64's step."""
    z = np.uint64(x) + (np.uint64(counter) + ONE) * GOLDEN
    z = (z ^ (z >> SHIFT_1)) * MIX_1
    z = (z ^ (z >> SHIFT_2)) * MIX_2
    return z ^ (z >> SHIFT_3)


def unit(x, counter):
    """The number in [0, 1) of state ``x`` and the last counter: their sum's halves xor-ed, mixed by
    MurmurHash3's finaliser in 32 bits (the products' low words), the top 24 bits times ``2**-24``."""
    z = np.uint64(x) + (np.uint64(counter) + ONE) * GOLDEN
    y = (z ^ (z >> HALF)) & LOW
    y = ((y ^ (y >> SIXTEEN)) * FMIX_1) & LOW
    y = ((y ^ (y >> THIRTEEN)) * FMIX_2) & LOW
    y = y ^ (y >> SIXTEEN)
    return np.float32(y >> EIGHT) * UNIT


def uniform(*counters: np.ndarray) -> np.ndarray:
    """``ac.random`` of integer arrays (broadcast), as float32."""
    *first, last = (np.asarray(c).astype(np.uint64) for c in counters)
    x = np.zeros((), np.uint64)
    with np.errstate(over="ignore"):
        for c in first:
            x = step(x, c)
        return np.asarray(unit(x, last), dtype=np.float32)


@register
class Random(Elementwise):
    """A uniform float32 in [0, 1) hashed from its integer operands (see the module docstring)."""

    name = "ac.random"
    num_operands = None

    def infer(self, operands, attrs, declared, checker):
        if not operands:
            raise TypeCheckError("ac.random: needs at least one integer operand")
        for t in operands:
            if not t.dtype.startswith("i") or t.dtype == "i1":
                raise TypeCheckError(f"ac.random: operands must be integer tensors, got {t.dtype}")
        return [TensorType(checker.broadcast([t.shape for t in operands], self.name), "f32")]

    def evaluate(self, op, args, ctx):
        return [uniform(*args)]
