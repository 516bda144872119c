"""Random inputs and error measures for checking backends against the interpreter, and a
count of the compilations a block of calls causes."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np

from attncomp.ir.core import Func
from attncomp.ir.types import NUMPY_DTYPES, is_float

#: relative error bound of a result of each element type against float64
TOLERANCE = {"f16": 2e-2, "bf16": 6e-2, "f32": 2e-5, "f64": 1e-10}


def random_inputs(func: Func, sizes: dict[str, int], seed: int = 0) -> list[np.ndarray]:
    """Standard-normal floats, integers in [0, smallest size), random bools.

    Raises ``KeyError`` naming the sizes that ``sizes`` lacks.
    """
    needed = sorted({d.symbol for a in func.args for d in a.type.shape if d.is_symbol})
    missing = [n for n in needed if n not in sizes]
    if missing:
        raise KeyError(f"give sizes for {', '.join(missing)} (the spec uses {', '.join(needed)})")
    rng = np.random.default_rng(seed)
    int_high = max(1, min(sizes[n] for n in needed)) if needed else 2
    arrays = []
    for arg in func.args:
        shape = arg.type.concrete_shape(sizes)
        dtype = arg.type.dtype
        if is_float(dtype):
            arrays.append(rng.standard_normal(shape).astype(NUMPY_DTYPES[dtype]))
        elif dtype == "i1":
            arrays.append(rng.random(shape) < 0.5)
        else:
            arrays.append(rng.integers(0, int_high, size=shape).astype(NUMPY_DTYPES[dtype]))
    return arrays


def relative_error(result: np.ndarray, reference: np.ndarray) -> float:
    """max |result - reference| / max |reference| over finite reference entries.

    Entries where both are the same infinity, or both NaN, agree; an entry
    where only one side is non-finite is an infinite error.
    """
    got = np.asarray(result, dtype=np.float64)
    ref = np.asarray(reference, dtype=np.float64)
    if got.shape != ref.shape:
        raise ValueError(f"shapes differ: {got.shape} against {ref.shape}")
    finite = np.isfinite(ref)
    same_special = (~finite) & ((got == ref) | (np.isnan(got) & np.isnan(ref)))
    if np.any(~finite & ~same_special) or np.any(finite & ~np.isfinite(got)):
        return float("inf")
    if not finite.any():
        return 0.0
    scale = max(float(np.max(np.abs(ref[finite]))), np.finfo(np.float64).tiny)
    return float(np.max(np.abs(got[finite] - ref[finite]))) / scale


def worst_error(results: Sequence[np.ndarray], references: Sequence[np.ndarray]) -> float:
    return max((relative_error(r, e) for r, e in zip(results, references)), default=0.0)


def tolerance_for(dtypes: Sequence[str]) -> float:
    """The loosest bound among the float result types."""
    floats = [TOLERANCE[d] for d in dtypes if d in TOLERANCE]
    return max(floats) if floats else 0.0


def interpret_float64(func: Func, args: Sequence[np.ndarray], sizes: dict[str, int] | None = None) -> list:
    """Run ``func`` in the interpreter on float64 arguments as given (no rounding to the declared types)."""
    from attncomp.ir.interpreter import interpret_unrounded

    return interpret_unrounded(func, args, sizes=sizes)


def directional_derivatives(
    func: Func,
    args: Sequence[np.ndarray],
    cotangents: Sequence[np.ndarray],
    directions: Sequence[np.ndarray | None],
    eps: float = 1e-6,
) -> list[float | None]:
    """Central differences of ``sum(cotangent * result)`` (finite results) along each argument's direction.

    ``d/dt f(args[k] + t * directions[k])`` at ``t = 0`` for each ``k`` with a
    direction; ``None`` where the direction is ``None``.  Compare with
    ``sum(gradient[k] * directions[k])`` from a pullback.
    """
    base = [np.asarray(a, dtype=np.float64) if np.asarray(a).dtype.kind == "f" else np.asarray(a) for a in args]

    def objective(values: list[np.ndarray]) -> float:
        outputs = interpret_float64(func, values)
        finite = [(c, np.isfinite(o), o) for c, o in zip(cotangents, outputs)]
        return float(sum(np.sum(c * np.where(seen, o, 0.0)) for c, seen, o in finite))

    found: list[float | None] = []
    for k, direction in enumerate(directions):
        if direction is None:
            found.append(None)
            continue
        plus, minus = list(base), list(base)
        plus[k] = base[k] + eps * direction
        minus[k] = base[k] - eps * direction
        found.append((objective(plus) - objective(minus)) / (2 * eps))
    return found


@contextmanager
def counting_compiles() -> Iterator[list[str]]:
    """The Numba compilations that the calls inside the block cause, by function name, as a list
    filled while it runs (a kernel loaded from the disk cache is no compilation). attncomp's
    kernels are shape-generic: after a function's first call at a head dimension and type, a call
    at any other length compiles nothing.

    >>> with counting_compiles() as compiled:
    ...     fn(q, k, v)
    >>> compiled
    []
    """
    from numba.core import event

    compiled: list[str] = []

    class Listener(event.Listener):
        def on_start(self, ev: event.Event) -> None:
            pass

        def on_end(self, ev: event.Event) -> None:
            dispatcher = (ev.data or {}).get("dispatcher")
            compiled.append(getattr(dispatcher, "__qualname__", None) or getattr(dispatcher, "__name__", "?"))

    with event.install_listener("numba:compile", Listener()):
        yield compiled
