"""Gradients of a compilation: the forward that saves residuals, the compiled backward, the pullback.

``autodiff`` runs on the fused graph (just before flash-tiling) and makes
the backward a function of its own: it takes the spec's arguments, the saved
results of the forward (each fused attention's output and LSE) and one
cotangent per result, and returns one gradient per floating argument.
``save-residuals`` makes the forward that also returns what the backward reads.
Both are compiled once per compilation (``Compilation.variant``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from attncomp.compilation import Compilation
from attncomp.errors import ShapeError
from attncomp.ir.types import NUMPY_DTYPES, is_float
from attncomp.passes.pipeline import edit_pipeline, make_pass


def backward_of(c: Compilation, without: tuple[str, ...] = ()) -> Compilation:
    """The compiled backward: ``autodiff`` after the graph passes, then tiled like the forward.

    ``without``: floating arguments, by name, whose gradients it neither computes nor returns.
    """

    def make() -> Compilation:
        autodiff = make_pass("autodiff", without="+".join(without))
        passes = edit_pipeline(c.passes, insert=autodiff, before="flash-tiling")
        return c.derive(passes, name=f"{c.name}_backward")

    return c.variant(("backward", *without) if without else "backward", make)


def saving_forward_of(c: Compilation) -> Compilation:
    """The forward that also returns what the backward reads (``save-residuals``)."""

    def make() -> Compilation:
        return c.derive(edit_pipeline(c.passes, insert=make_pass("save-residuals"), before="flash-tiling"))

    return c.variant("saving", make)


def vjp(
    c: Compilation, args: tuple[Any, ...], wrt: Sequence[str] | None = None
) -> tuple[Any, Callable[..., tuple[np.ndarray | None, ...]]]:
    """Run the forward; return its result and ``pullback(*cotangents) -> one gradient per argument``.

    ``pullback`` takes one cotangent per result (``None``: zero) and gives, per argument, an
    array of its shape and element type (float64 on ``interp``, the reference), or ``None`` for
    integer and boolean arguments.  ``wrt``: the floating arguments, by name, whose gradients are
    wanted (None: all); the others' are not returned (``None``), and the backward compiled without
    them does not compute those a fused attention does not need (a mask or bias it reads).
    """
    without = unwanted_arguments(c, wrt)
    forward = saving_forward_of(c)
    exact = c.program.reference
    outputs = forward.run(args, exact=exact)
    n_saved = forward.func.attrs.get("residuals", 0)
    results, saved = outputs[: len(outputs) - n_saved], outputs[len(outputs) - n_saved :]
    wanted = [a for a in c.func.args if is_float(a.type.dtype) and a.name not in without]
    backward = backward_of(c, without) if wanted else None  # None: no gradient wanted, none computed
    result_types = [v.type for v in c.func.results]
    arg_names = [a.name for a in c.func.args]

    def pullback(*cotangents: Any) -> tuple[np.ndarray | None, ...]:
        if len(cotangents) != len(results):
            raise TypeError(
                f"pullback of @{c.name} takes {len(results)} cotangent(s), one per result, got {len(cotangents)}"
            )
        filled = []
        for k, (cot, r, t) in enumerate(zip(cotangents, results, result_types)):
            dtype = np.float64 if exact else NUMPY_DTYPES[t.dtype]
            shape = tuple(r.shape) if hasattr(r, "shape") else np.shape(r)  # device results: never copied
            if cot is None:
                filled.append(np.zeros(shape, dtype=dtype))
                continue
            on_device = c.program.on_device(cot)  # bound, type-checked, as the backward's argument
            cot = cot if on_device else np.asarray(cot)
            if tuple(cot.shape) != shape:
                raise ShapeError(f"cotangent {k}: expected shape {shape} (result {k}), got {tuple(cot.shape)}")
            filled.append(cot if on_device else cot.astype(dtype, copy=False))
        if backward is None:
            return tuple(None for _ in c.func.args)
        grads = iter(backward.run([*args, *saved, *filled], exact=exact))
        return tuple(next(grads) if is_float(v.type.dtype) and v.name not in without else None for v in c.func.args)

    pullback.__doc__ = f"Gradients of ({', '.join(arg_names)}) from one cotangent per result."
    primal = results[0] if len(results) == 1 else tuple(results)
    return primal, pullback


def unwanted_arguments(c: Compilation, wrt: Sequence[str] | None) -> tuple[str, ...]:
    """The floating arguments not named in ``wrt`` (None: none), checked: a name that is no argument,
    or an argument that is not floating (it has no gradient), is a ``TypeError`` naming it."""
    if wrt is None:
        return ()
    if isinstance(wrt, str):
        raise TypeError(f"wrt: a sequence of argument names, such as ({wrt!r},), not a string")
    floating = [a.name for a in c.func.args if is_float(a.type.dtype)]
    names = [a.name for a in c.func.args]
    for name in wrt:
        if name not in names:
            raise TypeError(f"wrt: @{c.name} has no argument {name!r}; its arguments: {', '.join(names)}")
        if name not in floating:
            raise TypeError(f"wrt: {name!r} is not a floating argument of @{c.name}: it has no gradient")
    return tuple(name for name in floating if name not in wrt)
