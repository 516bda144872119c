"""Which scalar IR values are never negative, read from the ops that make them.

A kernel may rely on it: a softmax whose scores are ``s * c`` with ``c >= 0`` takes its row maximum
of ``s`` and scales that (``max(c s) = c max(s)``), and folds ``c`` into the exponent's one
multiply-add (``mma/flash_kernel.py``).  Rules:

    ac.dim                    a size: never negative
    ac.constant               its value
    ac.exp, ac.sqrt, ac.abs   never negative (a square root of a negative is NaN, not negative)
    ac.rsqrt                  likewise
    ac.pow                    a non-negative base: never negative
    ac.mul, ac.div, ac.add    both operands non-negative
    ac.maximum                either operand non-negative
    ac.minimum                both operands non-negative
    ac.cast                   its operand (a float type keeps the sign)

Anything else (a function's argument, a value loaded from memory) may be negative.
"""

from __future__ import annotations

from attncomp.ir.core import Value, producer

#: ops whose result is never negative, whatever their operands
ALWAYS = frozenset({"ac.dim", "ac.exp", "ac.sqrt", "ac.rsqrt", "ac.abs"})
#: ops whose result is non-negative where every operand is
EVERY = frozenset({"ac.mul", "ac.div", "ac.add", "ac.minimum", "ac.cast"})


def nonnegative(value: Value) -> bool:
    """Whether ``value`` is never negative (False: it may be, or that is not known)."""
    op = producer(value)
    if op is None:
        return False
    if op.name in ALWAYS:
        return True
    if op.name == "ac.constant":
        c = op.attrs["value"]
        return isinstance(c, (int, float)) and not isinstance(c, bool) and c >= 0
    if op.name == "ac.pow":
        return nonnegative(op.operands[0])
    if op.name == "ac.maximum":
        return any(nonnegative(x) for x in op.operands)
    if op.name in EVERY:
        return all(nonnegative(x) for x in op.operands)
    return False
