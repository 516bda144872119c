"""Elementwise ops with numpy broadcasting.

Promotion: bool < int < float; within the winning category a tensor of rank
> 0 decides over a 0-d one (so ``s * 0.125`` stays f32), then the wider type.

    %s_1 = ac.mul %s, %scale : tensor<B x H x T x S x f32>
    %m = ac.cmp %j, %i {pred = "le"} : tensor<1 x 1 x T x S x i1>
    %e = ac.exp %d : tensor<B x H x T x S x f32>
    %w = ac.where %m, %s, %ninf : tensor<B x H x T x S x f32>
"""

from __future__ import annotations

from collections.abc import Callable
from functools import reduce
from typing import Any, ClassVar

import numpy as np

from attncomp.errors import TypeCheckError
from attncomp.ir.ops.base import Checker, EvalContext, OpDef, register, require_attr
from attncomp.ir.types import BOOL_DTYPE, TensorType, category, is_float, wider


def promote(types: list[TensorType]) -> str:
    top = max(category(t.dtype) for t in types)
    same = [t for t in types if category(t.dtype) == top]
    deciding = [t for t in same if t.rank > 0] or same
    return reduce(wider, [t.dtype for t in deciding])


def _float_result(dtype: str, types: list[TensorType]) -> str:
    """Result dtype of an op that always produces floats."""
    if is_float(dtype):
        return dtype
    return "f32" if any(t.rank > 0 for t in types) else "f64"


class Elementwise(OpDef):
    """Shared rule: broadcast the operand shapes, promote the dtypes."""

    #: "same" keeps the promoted dtype, "float" forces a float, "bool" gives i1
    result_kind: ClassVar[str] = "same"
    #: operand categories accepted: "any", "number" (not bool), "bool"
    accepts: ClassVar[str] = "number"
    fn: ClassVar[Callable[..., np.ndarray]]

    def infer(self, operands, attrs, declared, checker: Checker):
        what = self.name
        if len(operands) != self.num_operands:
            raise TypeCheckError(f"{what}: expects {self.num_operands} operands, got {len(operands)}")
        for t in operands:
            if self.accepts == "number" and t.dtype == BOOL_DTYPE:
                raise TypeCheckError(f"{what}: operands must be numbers, got a bool tensor")
            if self.accepts == "bool" and t.dtype != BOOL_DTYPE:
                raise TypeCheckError(f"{what}: operands must be bool tensors, got {t.dtype}")
        shape = checker.broadcast([t.shape for t in operands], what)
        dtype = promote(operands)
        if self.result_kind == "float":
            dtype = _float_result(dtype, operands)
        elif self.result_kind == "bool":
            dtype = BOOL_DTYPE
        return [TensorType(shape, dtype)]

    def evaluate(self, op, args, ctx: EvalContext):
        with np.errstate(all="ignore"):
            return [np.asarray(type(self).fn(*args))]


def _define(name: str, arity: int, fn: Callable, result_kind: str, accepts: str, doc: str) -> None:
    attrs = {
        "name": name,
        "num_operands": arity,
        "result_kind": result_kind,
        "accepts": accepts,
        "fn": staticmethod(fn),
        "__doc__": doc,
    }
    register(type(name.replace(".", "_"), (Elementwise,), attrs))


def _unary(name: str, fn: Callable, result_kind: str = "same", accepts: str = "number", doc: str = ""):
    _define(name, 1, fn, result_kind, accepts, doc)


def _binary(name: str, fn: Callable, result_kind: str = "same", accepts: str = "number", doc: str = ""):
    _define(name, 2, fn, result_kind, accepts, doc)


def _rsqrt(x: np.ndarray) -> np.ndarray:
    return 1.0 / np.sqrt(x)


def _div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.true_divide(a, b)


def _pow(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.power(np.asarray(a, dtype=np.float64), b)


_unary("ac.neg", np.negative, doc="Negation: -x.")
_unary("ac.abs", np.abs, doc="Absolute value.")
_unary("ac.exp", np.exp, "float", doc="e**x.")
_unary("ac.log", np.log, "float", doc="Natural logarithm.")
_unary("ac.tanh", np.tanh, "float", doc="Hyperbolic tangent.")
_unary("ac.sqrt", np.sqrt, "float", doc="Square root.")
_unary("ac.sin", np.sin, "float", doc="Sine (radians).")
_unary("ac.cos", np.cos, "float", doc="Cosine (radians).")
_unary("ac.rsqrt", _rsqrt, "float", doc="1 / sqrt(x).")
_unary("ac.not", np.logical_not, "bool", "bool", doc="Logical not of a bool tensor.")

_binary("ac.add", np.add, doc="a + b.")
_binary("ac.sub", np.subtract, doc="a - b.")
_binary("ac.mul", np.multiply, doc="a * b.")
_binary("ac.div", _div, "float", doc="True division a / b; integers give a float.")
_binary("ac.floordiv", np.floor_divide, doc="Floor division a // b (rounds toward -inf).")
_binary("ac.mod", np.mod, doc="a % b with the sign of b, as in Python.")
_binary("ac.pow", _pow, "float", doc="a ** b.")
_binary("ac.maximum", np.maximum, doc="Elementwise maximum; NaN propagates.")
_binary("ac.minimum", np.minimum, doc="Elementwise minimum; NaN propagates.")
_binary("ac.and", np.logical_and, "bool", "bool", doc="Logical and of bool tensors.")
_binary("ac.or", np.logical_or, "bool", "bool", doc="Logical or of bool tensors.")

PREDICATES: dict[str, Callable] = {
    "lt": np.less,
    "le": np.less_equal,
    "gt": np.greater,
    "ge": np.greater_equal,
    "eq": np.equal,
    "ne": np.not_equal,
}


@register
class Cmp(Elementwise):
    """Comparison with ``pred`` one of lt, le, gt, ge, eq, ne; gives i1.

    %c = ac.cmp %j, %i {pred = "le"} : tensor<1 x 1 x T x S x i1>
    """

    name = "ac.cmp"
    num_operands = 2
    result_kind = "bool"
    accepts = "any"
    attributes = {"pred": "one of lt, le, gt, ge, eq, ne"}

    def infer(self, operands, attrs, declared, checker):
        pred = require_attr(attrs, "pred", str, self.name)
        if pred not in PREDICATES:
            raise TypeCheckError(f"ac.cmp: unknown predicate {pred!r}; valid: {', '.join(PREDICATES)}")
        return super().infer(operands, attrs, declared, checker)

    def evaluate(self, op, args, ctx):
        with np.errstate(all="ignore"):
            return [np.asarray(PREDICATES[op.attrs["pred"]](*args))]


@register
class Where(OpDef):
    """Select: ``cond ? a : b`` elementwise, broadcasting all three.

    %s_2 = ac.where %mask, %s_1, %ninf : tensor<B x H x T x S x f32>
    """

    name = "ac.where"
    num_operands = 3

    def infer(self, operands, attrs, declared, checker):
        if len(operands) != 3:
            raise TypeCheckError(f"ac.where: expects 3 operands, got {len(operands)}")
        cond, a, b = operands
        if cond.dtype != BOOL_DTYPE:
            raise TypeCheckError(f"ac.where: the condition must be a bool tensor, got {cond.dtype}")
        shape = checker.broadcast([cond.shape, a.shape, b.shape], self.name)
        return [TensorType(shape, promote([a, b]))]

    def evaluate(self, op, args, ctx):
        return [np.asarray(np.where(*args))]


@register
class Cast(OpDef):
    """Convert to the element type of the declared result.

    %h = ac.cast %x : tensor<B x T x f32>
    """

    name = "ac.cast"
    num_operands = 1
    declared_result = True

    def infer(self, operands, attrs: dict[str, Any], declared, checker):
        if not declared or len(declared) != 1:
            raise TypeCheckError("ac.cast: needs one declared result type")
        if declared[0].shape != operands[0].shape:
            raise TypeCheckError("ac.cast: the result must have the operand's shape")
        return declared

    def evaluate(self, op, args, ctx):
        dtype = op.results[0].type.dtype
        if dtype == BOOL_DTYPE:
            return [np.asarray(args[0] != 0)]
        if dtype.startswith("i"):
            return [np.asarray(args[0]).astype(np.int64)]
        return [np.asarray(args[0], dtype=np.float64)]
