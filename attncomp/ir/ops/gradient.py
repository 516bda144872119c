"""Ops that the autodiff pass introduces.

    %g = ac.scatter_add %upd, %h : tensor<H x f32>
    %dq, %dk, %dv, %dslopes = ac.attention_grad %q, %k, %v, %out, %lse, %d_out, %d_lse {kv_repeat = 1}
        : tensor<B x H x T x D x f32>, tensor<B x H x S x D x f32>, tensor<B x H x S x E x f32>, tensor<H x f32> ({
    ^bb0(%b, %h, %i, %j, %s):        // the forward's score function
      ...
    }, {
    ^bb0(%b, %h, %i, %j):            // the forward's mask
      ...
    }, {
    ^bb0(%b, %h, %i, %j, %s, %g):    // its derivative: g = d loss / d score(s)
      ...
      ac.yield %ds, %site0, %site0_index0
    })

``ac.attention_grad`` is the reverse of ``ac.attention`` in the
FlashAttention-2 form: the probabilities are recomputed from the saved
log-sum-exp, ``delta = rowsum(d_out * out) - d_lse``, ``dP = d_out vᵀ``,
``dS = P * (dP - delta)``, and the gradient region maps ``dS`` (the gradient
of the score function's output) to the gradient of the raw ``q kᵀ`` element
and to the contributions to captured tensors the score function reads
("sites").  ``dq = dS_raw k``, ``dk = dS_rawᵀ q``, ``dv = Pᵀ d_out``, with
groups of ``kv_repeat`` query heads summed into their key/value head.
With ``normalized = false`` (the forward's, sigmoid attention) the probabilities are
``P = exp(score)``, not divided by a row's sum: ``dS = P * dP``; the LSE operands are not read (its
log-sum-exp, which only chunk pairs and saved residuals return, passes no gradient).
"""

from __future__ import annotations

import numpy as np

from attncomp.errors import TypeCheckError
from attncomp.ir.dims import Dim, dim
from attncomp.ir.ops.attention import attention_types, expand_heads, index_grids, normalized, weight_of
from attncomp.ir.ops.base import OpDef, register, require_attr
from attncomp.ir.ops.elementwise import promote
from attncomp.ir.ops.structural import check_indices
from attncomp.ir.types import BOOL_DTYPE, TensorType, is_float, is_int, score_dtype


def scatter_into(target: np.ndarray, updates: np.ndarray, indices: list[np.ndarray], what: str) -> None:
    """``target[indices] += updates`` with repeated positions adding up (``np.add.at``)."""
    if target.ndim == 0:
        target[...] += np.sum(updates)
        return
    check_indices(target.shape, indices, what)
    shape = np.broadcast_shapes(np.shape(updates), *(np.shape(i) for i in indices))
    idx = tuple(np.broadcast_to(np.asarray(i, dtype=np.int64), shape) for i in indices)
    np.add.at(target, idx, np.broadcast_to(updates, shape))


def sum_to(x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Sum ``x`` over the axes that broadcasting stretched to reach ``x.shape`` from ``shape``."""
    extra = x.ndim - len(shape)
    if extra:
        x = x.sum(axis=tuple(range(extra)))
    axes = tuple(k for k, n in enumerate(shape) if n == 1 and x.shape[k] != 1)
    return x.sum(axis=axes, keepdims=True) if axes else x


@register
class ScatterAdd(OpDef):
    """Zeros of the declared type with ``updates`` added at ``[idx_0, ..., idx_r-1]``.

    The reverse of ``ac.gather``: positions read several times add up.
    Updates and indices broadcast together; an index outside its axis is an
    error, as for ``ac.gather``.
    """

    name = "ac.scatter_add"
    declared_result = True

    def infer(self, operands, attrs, declared, checker):
        if not declared or len(declared) != 1:
            raise TypeCheckError(f"{self.name}: needs one declared result type")
        if not operands:
            raise TypeCheckError(f"{self.name}: needs the updates")
        updates, *indices = operands
        target = declared[0]
        if len(indices) != target.rank:
            raise TypeCheckError(f"{self.name}: a result of rank {target.rank} needs {target.rank} index tensors")
        if not is_float(updates.dtype) or updates.dtype != target.dtype:
            raise TypeCheckError(f"{self.name}: updates must be floats of the result's element type")
        for k, idx in enumerate(indices):
            if not is_int(idx.dtype):
                raise TypeCheckError(f"{self.name}: index {k} must be an integer tensor, got {idx.dtype}")
        checker.broadcast([t.shape for t in operands], self.name)
        return declared

    def evaluate(self, op, args, ctx):
        updates, *indices = args
        out = np.zeros(op.results[0].type.concrete_shape(ctx.env), dtype=np.float64)
        scatter_into(out, updates, indices, "ac.gather")
        return [out]


def site_ranks(op) -> list[int]:
    """The rank of each site's gradient (results after dq, dk, dv)."""
    return [r.type.rank for r in op.results[3:]]


@register
class AttentionGrad(OpDef):
    """The gradients of ``ac.attention`` (see the module docstring)."""

    name = "ac.attention_grad"
    num_operands = 7
    declared_result = True
    attributes = {
        "kv_repeat": "query heads per key/value head (a dimension)",
        "normalized": "optional bool: false: the forward's probabilities were exp(score), not divided by a row's sum",
    }

    def infer(self, operands, attrs, declared, checker):
        if not isinstance(attrs.get("normalized", True), bool):
            raise TypeCheckError(f"{self.name}: attribute 'normalized' is a bool")
        if len(operands) != 7:
            raise TypeCheckError(f"{self.name}: expects q, k, v, out, lse, d_out, d_lse, got {len(operands)} operands")
        q, k, v, out, lse, d_out, d_lse = operands
        kv_repeat = dim(require_attr(attrs, "kv_repeat", (int, Dim), self.name))
        want_out, want_lse = attention_types(q, k, v, kv_repeat, True, checker, self.name)
        for name, got, want in (("out", out, want_out), ("d_out", d_out, want_out)):
            if got.rank != want.rank:
                raise TypeCheckError(f"{self.name}: {name} must be {want}, got {got}")
        for name, got in (("lse", lse), ("d_lse", d_lse)):
            if got.rank != want_lse.rank:
                raise TypeCheckError(f"{self.name}: {name} must be {want_lse}, got {got}")
        if not declared or len(declared) < 3:
            raise TypeCheckError(f"{self.name}: needs declared types for dq, dk, dv and each site")
        for name, got, want in zip(("dq", "dk", "dv"), declared, (q, k, v)):
            if got != want:
                raise TypeCheckError(f"{self.name}: {name} must have the type of its operand, {want}")
        for t in declared[3:]:
            if not is_float(t.dtype):
                raise TypeCheckError(f"{self.name}: site gradients must be floats, got {t}")
        return declared

    def verify_regions(self, op) -> None:
        if len(op.regions) not in (3, 4):
            raise TypeCheckError(
                f"{self.name}: needs a score, a mask and a gradient region, optionally a weight region"
            )
        if len(op.regions) == 4:
            index = [TensorType((), "i64")] * op.operands[3].type.rank
            score = TensorType((), score_dtype(promote([op.operands[0].type, op.operands[1].type])))
            weight = op.regions[3]
            if [a.type for a in weight.args] != index or [v.type for v in weight.ops[-1].operands] != [score]:
                raise TypeCheckError(f"{self.name}: the weight region takes the positions and yields one {score}")
        rank = op.operands[3].type.rank
        score = TensorType((), score_dtype(promote([op.operands[0].type, op.operands[1].type])))
        index = TensorType((), "i64")
        expected = [[index] * rank + [score], [index] * rank, [index] * rank + [score, score]]
        for which, region, args in zip(("score", "mask", "gradient"), op.regions, expected):
            if [a.type for a in region.args] != args:
                raise TypeCheckError(f"{self.name}: the {which} region takes ({', '.join(map(str, args))})")
        yields = [[score], [TensorType((), BOOL_DTYPE)]]
        for which, region, want in zip(("score", "mask"), op.regions[:2], yields):
            if [v.type for v in region.ops[-1].operands] != want:
                raise TypeCheckError(f"{self.name}: the {which} region must yield one {want[0]}")
        grad_yield = [v.type for v in op.regions[2].ops[-1].operands]
        want = [score]
        for site in op.results[3:]:
            want += [TensorType((), site.type.dtype)] + [TensorType((), "i64")] * site.type.rank
        if len(grad_yield) != len(want) or grad_yield[0] != score:
            raise TypeCheckError(f"{self.name}: the gradient region must yield the score's gradient, then per site")
        for got, expect in zip(grad_yield[1:], want[1:]):
            if got.rank != 0 or (is_float(expect.dtype) != is_float(got.dtype)):
                raise TypeCheckError(f"{self.name}: the gradient region yields a contribution and indices per site")

    def evaluate(self, op, args, ctx):
        q, k, v, out, lse, d_out, d_lse = args
        n_rep = dim(op.attrs["kv_repeat"]).evaluate(ctx.env)
        ke, ve = expand_heads(k, n_rep), expand_heads(v, n_rep)
        raw = np.matmul(q, np.swapaxes(ke, -1, -2))
        grids = index_grids(raw.shape)
        with np.errstate(all="ignore"):
            scored = np.broadcast_to(ctx.run_block(op.regions[0], [*grids, raw])[0], raw.shape)
            visible = np.broadcast_to(ctx.run_block(op.regions[1], grids)[0], raw.shape)
            if normalized(op):
                lse_b = np.asarray(lse)[..., None]
                p = np.where(
                    visible & np.isfinite(lse_b), np.exp(scored - np.where(np.isfinite(lse_b), lse_b, 0.0)), 0.0
                )
                delta = np.sum(d_out * out, axis=-1) - d_lse
            else:  # P = exp(score): no row sum, so no delta
                p = np.where(visible, np.exp(scored), 0.0)
                delta = np.zeros(raw.shape[:-1])
            weight = weight_of(op, grids, ctx, at=3)
            dp = np.matmul(d_out, np.swapaxes(ve, -1, -2)) * weight
            ds = p * (dp - delta[..., None])
            grads = ctx.run_block(op.regions[2], [*grids, raw, ds])
            ds_raw = np.where(visible, np.broadcast_to(grads[0], raw.shape), 0.0)
            dq = np.matmul(ds_raw, ke)
            dk = np.matmul(np.swapaxes(ds_raw, -1, -2), q)
            dv = np.matmul(np.swapaxes(p * weight, -1, -2), d_out)
        results = [sum_to(dq, q.shape)]
        for full, operand in ((dk, k), (dv, v)):
            if n_rep != 1:
                full = full.reshape(full.shape[:1] + (full.shape[1] // n_rep, n_rep) + full.shape[2:]).sum(axis=2)
            results.append(sum_to(full, operand.shape))
        at = 1
        for site in op.results[3:]:
            target = np.zeros(site.type.concrete_shape(ctx.env), dtype=np.float64)
            contribution = np.where(visible, np.broadcast_to(grads[at], raw.shape), 0.0)
            indices = grads[at + 1 : at + 1 + site.type.rank]
            scatter_into(target, contribution, indices, "ac.gather")
            results.append(target)
            at += 1 + site.type.rank
        return results
