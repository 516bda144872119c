"""``ac.random``: a uniform number in [0, 1) that is a function of integer counters.

    %u = ac.random %seed, %b, %h, %i, %j : tensor<1 x 1 x T x S x f32>

The counters (integer tensors, broadcast together) are hashed, one at a time, by
SplitMix64's mixing function: ``x = 0``, then ``x = mix(x + (c + 1) * golden)`` per counter
``c``, and the result is the top 24 bits of ``x`` divided by ``2**24``: a float32 in
``[0, 1 - 2**-24]``, every value a multiple of ``2**-24``.  Nothing is stored between calls:
the same counters give the same number in the reference interpreter, on the CPU and on the
GPU, so attention dropout (``ac.dropout``) draws its mask in the forward and draws it again,
equal bit for bit, in the backward.

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
ONE = np.uint64(1)
SHIFT_1, SHIFT_2, SHIFT_3, TOP = np.uint64(30), np.uint64(27), np.uint64(31), np.uint64(40)
#: 2**-24: the unit of the numbers drawn
UNIT = np.float32(1.0 / (1 << 24))


def step(x, counter):
    """The state after hashing in ``counter`` (both taken as ``uint64``: a negative counter wraps)."""
    z = np.uint64(x) + (np.uint64(counter) + ONE) * GOLDEN
    z = (z ^ (z >> SHIFT_1)) * MIX_1
    z = (z ^ (z >> SHIFT_2)) * MIX_2
    return z ^ (z >> SHIFT_3)


def unit(x):
    """The number in [0, 1) a state gives: its top 24 bits times ``2**-24``."""
    return np.float32(x >> TOP) * UNIT


def uniform(*counters: np.ndarray) -> np.ndarray:
    """``ac.random`` of integer arrays (broadcast), as float32."""
    x = np.zeros((), np.uint64)
    with np.errstate(over="ignore"):
        for c in counters:
            x = step(x, np.asarray(c).astype(np.uint64))
        return (np.asarray(x >> TOP).astype(np.float32) * UNIT).astype(np.float32)


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
