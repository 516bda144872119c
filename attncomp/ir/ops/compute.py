"""Matmul and reductions.

%s = ac.matmul %q, %kt : tensor<B x H x T x S x f32>
%m = ac.reduce %s {axes = [3], keepdims = true, kind = "max"} : tensor<B x H x T x 1 x f32>
%p = ac.softmax %s {axis = 3} : tensor<B x H x T x S x f32>
%lse = ac.logsumexp %s {axis = 3, keepdims = false} : tensor<B x H x T x f32>
"""

from __future__ import annotations

import numpy as np

from attncomp.errors import TypeCheckError
from attncomp.ir.dims import dim
from attncomp.ir.ops.base import OpDef, normalize_axis, register, require_attr
from attncomp.ir.ops.elementwise import promote
from attncomp.ir.types import BOOL_DTYPE, TensorType, is_float


@register
class Matmul(OpDef):
    """Batched matrix product ``a[..., M, K] @ b[..., K, N]``; batch axes broadcast."""

    name = "ac.matmul"

    def infer(self, operands, attrs, declared, checker):
        if len(operands) != 2:
            raise TypeCheckError(f"ac.matmul: expects 2 operands, got {len(operands)}")
        a, b = operands
        if a.rank < 2 or b.rank < 2:
            raise TypeCheckError(f"ac.matmul: operands need rank >= 2, got {a.rank} and {b.rank}")
        if BOOL_DTYPE in (a.dtype, b.dtype):
            raise TypeCheckError("ac.matmul: bool operands are not supported")
        k_a, k_b = a.shape[-1], b.shape[-2]
        checker.unify(k_a, k_b, f"ac.matmul: contracted dimension ({k_a} against {k_b})")
        batch = checker.broadcast([a.shape[:-2], b.shape[:-2]], "ac.matmul batch axes")
        return [TensorType(batch + (a.shape[-2], b.shape[-1]), promote([a, b]))]

    def evaluate(self, op, args, ctx):
        with np.errstate(all="ignore"):  # IEEE results (0 * inf = nan) are the meaning, not a warning
            return [np.matmul(*args)]


def _reduced_shape(src: TensorType, axes: list[int], keepdims: bool) -> list:
    if keepdims:
        return [dim(1) if k in axes else d for k, d in enumerate(src.shape)]
    return [d for k, d in enumerate(src.shape) if k not in axes]


def safe_max(x: np.ndarray, axis: tuple[int, ...] | int) -> np.ndarray:
    """Row maximum with -inf rows mapped to 0, so ``x - m`` stays -inf, not NaN."""
    if x.shape[axis] == 0:  # no keys at all: every row is empty, as if fully masked
        shape = list(x.shape)
        shape[axis] = 1
        return np.zeros(shape, dtype=x.dtype)
    m = np.max(x, axis=axis, keepdims=True)
    return np.where(m == -np.inf, 0.0, m).astype(x.dtype, copy=False)


REDUCTIONS = {"sum": np.sum, "max": np.max, "min": np.min, "mean": np.mean}


@register
class Reduce(OpDef):
    """Reduce ``axes`` with ``kind`` one of sum, max, min, mean; max of nothing is -inf, min +inf."""

    name = "ac.reduce"
    attributes = {"kind": "sum, max, min or mean", "axes": "sorted axes", "keepdims": "bool"}

    def infer(self, operands, attrs, declared, checker):
        if len(operands) != 1:
            raise TypeCheckError("ac.reduce: expects 1 operand")
        src = operands[0]
        kind = require_attr(attrs, "kind", str, self.name)
        if kind not in REDUCTIONS:
            raise TypeCheckError(f"ac.reduce: unknown kind {kind!r}; valid: {', '.join(REDUCTIONS)}")
        axes = [normalize_axis(a, src.rank, self.name) for a in require_attr(attrs, "axes", list, self.name)]
        keepdims = require_attr(attrs, "keepdims", bool, self.name)
        dtype = src.dtype
        if kind == "mean" and not is_float(dtype):
            dtype = "f32"
        return [TensorType(tuple(_reduced_shape(src, axes, keepdims)), dtype)]

    def evaluate(self, op, args, ctx):
        x = args[0]
        axes = tuple(a % x.ndim for a in op.attrs["axes"])
        kind, keepdims = op.attrs["kind"], op.attrs["keepdims"]
        with np.errstate(all="ignore"):
            if x.size == 0 and kind in ("max", "min"):
                # over no elements, max is -inf and min +inf (their identities): an empty key
                # axis behaves like a fully masked one
                initial = -np.inf if kind == "max" else np.inf
                out = REDUCTIONS[kind](x.astype(np.float64), axis=axes, keepdims=keepdims, initial=initial)
            else:
                out = REDUCTIONS[kind](x, axis=axes, keepdims=keepdims)
        return [np.asarray(out)]


def _float_operand(operands: list[TensorType], what: str) -> TensorType:
    if len(operands) != 1:
        raise TypeCheckError(f"{what}: expects 1 operand")
    if not is_float(operands[0].dtype):
        raise TypeCheckError(f"{what}: needs a float tensor, got {operands[0].dtype}")
    return operands[0]


@register
class Softmax(OpDef):
    """``exp(x - max) / sum(exp(x - max))`` along ``axis``.

    A slice whose every element is -inf (every key masked) gives zeros.
    """

    name = "ac.softmax"
    attributes = {"axis": "the normalised axis"}

    def infer(self, operands, attrs, declared, checker):
        src = _float_operand(operands, self.name)
        normalize_axis(require_attr(attrs, "axis", int, self.name), src.rank, self.name)
        return [src]

    def evaluate(self, op, args, ctx):
        x = args[0]
        axis = op.attrs["axis"] % x.ndim
        with np.errstate(all="ignore"):
            e = np.exp(x - safe_max(x, axis))
            total = np.sum(e, axis=axis, keepdims=True)
            return [e / np.where(total == 0.0, 1.0, total)]


@register
class LogSumExp(OpDef):
    """``log(sum(exp(x)))`` along ``axis``, computed stably; all -inf gives -inf."""

    name = "ac.logsumexp"
    attributes = {"axis": "the reduced axis", "keepdims": "bool"}

    def infer(self, operands, attrs, declared, checker):
        src = _float_operand(operands, self.name)
        axis = normalize_axis(require_attr(attrs, "axis", int, self.name), src.rank, self.name)
        keepdims = require_attr(attrs, "keepdims", bool, self.name)
        return [src.with_shape(_reduced_shape(src, [axis], keepdims))]

    def evaluate(self, op, args, ctx):
        x = args[0]
        axis = op.attrs["axis"] % x.ndim
        with np.errstate(all="ignore"):
            m = safe_max(x, axis)
            out = m + np.log(np.sum(np.exp(x - m), axis=axis, keepdims=True))
        if not op.attrs["keepdims"]:
            out = np.squeeze(out, axis=axis)
        return [np.asarray(out)]
