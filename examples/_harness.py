"""What every example's ``__main__`` block does: compile, run, compare, time.

Not an example itself (the leading underscore keeps it out of the list of
variants).  Each example imports it only under ``if __name__ == "__main__":``,
so the example modules stay importable from anywhere.

    python examples/causal.py           # backend "interp"
    python examples/causal.py cpu       # another backend, once it exists
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

import attncomp as ac
from attncomp import testing

#: interpreter against numpy, both float64: only rounding may differ
FLOAT64_TOLERANCE = testing.TOLERANCE["f64"]
#: a compiled function returns its declared element type, f32 here
FLOAT32_TOLERANCE = testing.TOLERANCE["f32"]


def backend_from_argv(default: str = "interp") -> str:
    return sys.argv[1] if len(sys.argv) > 1 else default


def worst_error(results: Any, references: Any) -> float:
    """The largest relative error over one result or a tuple of results.

    The measure is :func:`attncomp.testing.relative_error`; this only accepts
    a single array as well as a tuple, and refuses tuples of different lengths.
    """
    if not isinstance(results, tuple):
        results, references = (results,), (references,)
    if len(results) != len(references):
        raise ValueError(f"{len(results)} results against {len(references)} references")
    return testing.worst_error(results, references)


def check_round_trip(spec: ac.Spec, **constants: Any) -> None:
    """The IR text, as traced and with ``constants``, must parse back to the same text (docs/api.md 1)."""
    modules = [spec.ir, spec.trace(**constants)] if constants else [spec.ir]
    for module in modules:
        text = str(module)
        if str(ac.parse_ir(text)) != text:
            raise AssertionError(f"{spec.name}: the IR text does not survive parse_ir")


def timed(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, float]:
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    return result, time.perf_counter() - start


def shapes(inputs: Sequence[np.ndarray]) -> str:
    return ", ".join("x".join(map(str, a.shape)) or "scalar" for a in inputs)


def run_example(
    spec: ac.Spec,
    numpy_reference: Callable[..., Any],
    inputs: Sequence[np.ndarray],
    backend: str | None = None,
    **constants: Any,
) -> float:
    """Compile ``spec``, run it, and check it against the interpreter and numpy.

    Prints one report line per check; raises ``AssertionError`` when the
    interpreter and the numpy reference disagree beyond float64 rounding, or the
    compiled function and the interpreter beyond float32 rounding.  Returns
    the worst interpreter-against-numpy error.
    """
    backend = backend or backend_from_argv()
    check_round_trip(spec, **constants)
    settings = ", ".join(f"{k}={v}" for k, v in constants.items())
    print(f"{spec.name}({shapes(inputs)}){' with ' + settings if settings else ''}")

    fn, compile_seconds = timed(ac.compile, spec, backend=backend, **constants)
    fn(*inputs)  # a first call may build kernels; time the second
    compiled, compiled_seconds = timed(fn, *inputs)
    interpreted, interpret_seconds = timed(ac.interpret, spec, *inputs, **constants)
    expected, numpy_seconds = timed(numpy_reference, *inputs, **constants)

    compiled_error = worst_error(compiled, interpreted)
    reference_error = worst_error(interpreted, expected)
    report = [
        (f"compile   [{backend}]", compile_seconds, f"passes: {', '.join(fn.stages)}"),
        (f"compiled  [{backend}]", compiled_seconds, f"rel err vs interpret {compiled_error:.2e}"),
        ("interpret [float64]", interpret_seconds, f"rel err vs numpy     {reference_error:.2e}"),
        ("numpy     [float64]", numpy_seconds, ""),
    ]
    for what, seconds, note in report:
        print(f"  {what:<20} {seconds * 1e3:9.1f} ms  {note}".rstrip())
    if reference_error > FLOAT64_TOLERANCE:
        raise AssertionError(f"{spec.name}: interpreter and numpy reference differ ({reference_error:.2e})")
    if compiled_error > FLOAT32_TOLERANCE:
        raise AssertionError(f"{spec.name}: {backend} and interpreter differ ({compiled_error:.2e})")
    return reference_error
