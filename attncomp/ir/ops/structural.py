"""Leaves, gathers and terminators.

%c = ac.constant {value = 0.125} : tensor<f64>
%d = ac.dim {value = D} : tensor<i64>
%i = ac.iota {axis = 2} : tensor<1 x 1 x T x 1 x i64>
%g = ac.gather %slopes, %h : tensor<1 x H x 1 x 1 x f32>
ac.return %out, %lse
"""

from __future__ import annotations

import numpy as np

from attncomp.errors import TypeCheckError, with_location
from attncomp.ir.dims import Dim, dim
from attncomp.ir.ops.base import (
    EvalContext,
    OpDef,
    float64_like,
    normalize_axis,
    register,
    require_attr,
    single_declared,
)
from attncomp.ir.types import TensorType, is_float, is_int


@register
class Constant(OpDef):
    """A constant filling its declared type (usually 0-d); ``value`` is an int,
    a float (``inf``, ``-inf``, ``nan``) or a bool."""

    name = "ac.constant"
    num_operands = 0
    declared_result = True
    attributes = {"value": "int, float or bool"}

    def infer(self, operands, attrs, declared, checker):
        value = require_attr(attrs, "value", (int, float, bool), self.name)
        result = single_declared(declared, self.name)
        if isinstance(value, float) and not is_float(result.dtype):
            raise TypeCheckError(f"ac.constant: float value {value} declared as {result.dtype}")
        return declared

    def evaluate(self, op, args, ctx):
        rtype = op.results[0].type
        value = np.asarray(op.attrs["value"], dtype=float64_like(rtype.dtype))
        return [np.full(rtype.concrete_shape(ctx.env), value) if rtype.rank else value]


@register
class DimValue(OpDef):
    """The run-time size of a dimension expression, as a 0-d i64."""

    name = "ac.dim"
    num_operands = 0
    declared_result = True
    attributes = {"value": "a dimension expression"}

    def infer(self, operands, attrs, declared, checker):
        require_attr(attrs, "value", (Dim, int), self.name)
        result = single_declared(declared, self.name)
        if result != TensorType((), "i64"):
            raise TypeCheckError("ac.dim: the result must be tensor<i64>")
        return declared

    def evaluate(self, op, args, ctx: EvalContext):
        value = op.attrs["value"]
        size = value if isinstance(value, int) else value.evaluate(ctx.env)
        return [np.asarray(size, dtype=np.int64)]


@register
class Iota(OpDef):
    """Positions 0..n-1 along ``axis``, size 1 on every other axis (as ``np.ogrid``).

    ``ac.index(s)`` gives one iota per axis of ``s``.
    """

    name = "ac.iota"
    num_operands = 0
    declared_result = True
    attributes = {"axis": "the axis that counts"}

    def infer(self, operands, attrs, declared, checker):
        result = single_declared(declared, self.name)
        axis = normalize_axis(require_attr(attrs, "axis", int, self.name), result.rank, self.name)
        if result.dtype != "i64":
            raise TypeCheckError("ac.iota: the result must be i64")
        for k, d in enumerate(result.shape):
            if k != axis and not (d.is_const and d.value == 1):
                raise TypeCheckError(f"ac.iota: axis {k} must have size 1, not {d}")
        return declared

    def evaluate(self, op, args, ctx):
        rtype = op.results[0].type
        axis = op.attrs["axis"] % rtype.rank
        shape = rtype.concrete_shape(ctx.env)
        ramp = np.arange(shape[axis], dtype=np.int64)
        view = [1] * rtype.rank
        view[axis] = shape[axis]
        return [ramp.reshape(view)]


@register
class Gather(OpDef):
    """``src[idx_0, ..., idx_r-1]``: one integer index tensor per axis of ``src``.

    The result has the broadcast shape of the indices.  An index outside
    ``[0, size)`` is an error (no wrap-around of negative indices).
    """

    name = "ac.gather"

    def infer(self, operands, attrs, declared, checker):
        if not operands:
            raise TypeCheckError("ac.gather: needs a source operand")
        src, *indices = operands
        if len(indices) != src.rank:
            raise TypeCheckError(
                f"ac.gather: a source of rank {src.rank} needs {src.rank} index tensors, got {len(indices)}"
            )
        for k, idx in enumerate(indices):
            if not is_int(idx.dtype):
                raise TypeCheckError(f"ac.gather: index {k} must be an integer tensor, got {idx.dtype}")
        shape = checker.broadcast([t.shape for t in indices], self.name)
        return [TensorType(shape, src.dtype)]

    def evaluate(self, op, args, ctx):
        src, *indices = args
        check_indices(src.shape, indices, "ac.gather")
        return [np.asarray(src[tuple(indices)])]


def check_indices(shape: tuple[int, ...], indices: list[np.ndarray], what: str) -> None:
    """``IndexError`` for an index outside its axis (negative indices do not wrap around)."""
    for axis, idx in enumerate(indices):
        idx = np.asarray(idx)
        if idx.size and (idx.min() < 0 or idx.max() >= shape[axis]):
            bad = idx.min() if idx.min() < 0 else idx.max()
            raise IndexError(f"{what}: index {bad} is out of range for axis {axis} of size {shape[axis]}")


@register
class CheckIndex(OpDef):
    """Raises ``IndexError`` unless ``[lo, hi]`` lies inside ``[0, size)`` (or ``count`` is 0).

    flash-tiling puts one before a tiled attention for each axis of each gather in its
    regions: ``lo`` and ``hi`` bound that index over every position of the grid (interval
    arithmetic on the index expression, computed at call time from the sizes and captured
    values) and ``count`` is the number of positions.  The kernels then read without a check.
    ``exact`` says the bounds are attained, so a failure is the interpreter's own error;
    otherwise the message says the index *may* reach the bound.  ``at`` is the gather's
    ``file:line`` in the spec.
    """

    name = "ac.check_index"
    num_operands = 3
    effect = True
    attributes = {
        "axis": "the source axis the index is for",
        "size": "that axis's size (a dimension)",
        "exact": "bool: the bounds are attained over the grid",
        "at": "the gather's file:line in the spec, or empty",
    }

    def infer(self, operands, attrs, declared, checker):
        for t in operands:
            if t.rank != 0 or not is_int(t.dtype):
                raise TypeCheckError(f"{self.name}: lo, hi and count must be 0-d integers, got {t}")
        require_attr(attrs, "axis", int, self.name)
        require_attr(attrs, "size", (int, Dim), self.name)
        require_attr(attrs, "exact", bool, self.name)
        if declared:
            raise TypeCheckError(f"{self.name}: has no results")
        return []

    def evaluate(self, op, args, ctx):
        lo, hi, count = (int(np.asarray(a)) for a in args)
        size = dim(op.attrs["size"]).evaluate(ctx.env)
        check_index_range(lo, hi, count, size, op.attrs["axis"], op.attrs["exact"], op.attrs.get("at", ""))
        return []


def check_index_range(lo: int, hi: int, count: int, size: int, axis: int, exact: bool, at: str = "") -> None:
    """``IndexError`` when an index bounded by ``[lo, hi]`` may leave ``[0, size)`` (see ``ac.check_index``)."""
    if count <= 0 or (0 <= lo and hi < size):
        return
    bad = lo if lo < 0 else hi
    if exact:
        message = f"ac.gather: index {bad} is out of range for axis {axis} of size {size}"
    else:
        message = (
            f"ac.gather: an index may reach {bad}, out of range for axis {axis} of size {size} "
            "(its bound over every position, by interval arithmetic)"
        )
    raise IndexError(with_location(message, at))


class Terminator(OpDef):
    terminator = True

    def infer(self, operands, attrs, declared, checker):
        if declared:
            raise TypeCheckError(f"{self.name}: has no results")
        return []

    def evaluate(self, op, args, ctx):
        return []


@register
class Return(Terminator):
    """Ends a function; its operands are the function's results."""

    name = "ac.return"


@register
class Yield(Terminator):
    """Ends a region; its operands are the region's results."""

    name = "ac.yield"
