"""The fused attention op that softmax-fusion produces.

    %o, %lse = ac.attention %q, %k, %v {kv_repeat = 1, with_lse = true}
        : tensor<B x H x T x E x f32>, tensor<B x H x T x f32> ({
    ^bb0(%b: tensor<i64>, %h: tensor<i64>, %i: tensor<i64>, %j: tensor<i64>, %s: tensor<f32>):
      ...                                   // the score function of one element
      ac.yield %s_1
    }, {
    ^bb0(%b: tensor<i64>, %h: tensor<i64>, %i: tensor<i64>, %j: tensor<i64>):
      ...                                   // the mask: is key j visible to query i
      ac.yield %visible
    })

Meaning: with ``s = q @ kᵀ`` (head ``h`` of ``k`` and ``v`` is head
``h // kv_repeat``), ``s' = where(mask, score(s), -inf)``; the result is
``softmax(s') @ v`` and, when ``with_lse``, ``logsumexp(s')``, then, when ``with_max``
(an optional attribute), ``max(s')`` along the keys (each row's largest masked score, ``-inf``
where none is visible; no gradient flows through it).  An optional third
region, the **weight**, takes the positions and yields a factor for each probability
before ``@ v``, not counted in the softmax's sum (attention dropout: ``ac.dropout``):
the result is then ``(softmax(s') * weight) @ v``.  With the optional attribute ``normalized =
false`` the probabilities are not divided by their row's sum: the result is ``(exp(s') * weight)
@ v`` (sigmoid attention, whose score function ends in ``log sigmoid``: ``exp`` of it is the
sigmoid).  An optional ``score_bound`` says that no score exceeds it (``log sigmoid``'s 0): a
kernel may take it for every row's running max, never rescaling (any bound gives the same result;
it only keeps ``exp(s - m)`` from overflowing).  A query row with no visible key gives zeros and an
LSE of ``-inf``.  The regions see one score element at a time and may use values defined outside
the op.
"""

from __future__ import annotations

import numpy as np

from attncomp.errors import TypeCheckError
from attncomp.ir.core import Op, Value
from attncomp.ir.dims import Dim, dim
from attncomp.ir.ops.base import Checker, OpDef, register, require_attr
from attncomp.ir.ops.compute import safe_max
from attncomp.ir.ops.elementwise import promote
from attncomp.ir.types import BOOL_DTYPE, TensorType, score_dtype


def repeated(t: TensorType, kv_repeat: Dim) -> TensorType:
    """``t`` with its head axis (axis 1) repeated ``kv_repeat`` times."""
    if kv_repeat == dim(1):
        return t
    shape = list(t.shape)
    shape[1] = shape[1] * kv_repeat
    return t.with_shape(shape)


def attention_types(
    q: TensorType,
    k: TensorType,
    v: TensorType,
    kv_repeat: Dim,
    with_lse: bool,
    checker,
    what: str,
    with_max: bool = False,
) -> list[TensorType]:
    if q.rank < 2 or k.rank < 2 or v.rank < 2:
        raise TypeCheckError(f"{what}: q, k and v need rank >= 2")
    if kv_repeat != dim(1) and (k.rank < 3 or v.rank < 3):
        raise TypeCheckError(f"{what}: kv_repeat needs a head axis (axis 1) on k and v")
    k, v = repeated(k, kv_repeat), repeated(v, kv_repeat)
    checker.unify(q.shape[-1], k.shape[-1], f"{what}: head dimension of q and k")
    checker.unify(k.shape[-2], v.shape[-2], f"{what}: key length of k and v")
    batch = checker.broadcast([q.shape[:-2], k.shape[:-2], v.shape[:-2]], f"{what} batch axes")
    # the values' type (docs/ir.md, ac.matmul): what widened the scores does not widen the result
    out = [TensorType(batch + (q.shape[-2], v.shape[-1]), v.dtype)]
    for wanted in (with_lse, with_max):
        if wanted:
            out.append(TensorType(batch + (q.shape[-2],), lse_dtype(promote([q, k, v]))))
    return out


def with_max(op) -> bool:
    """Whether an ``ac.attention`` also returns each row's max score (its optional ``with_max``)."""
    return bool(op.attrs.get("with_max", False))


def normalized(op) -> bool:
    """Whether an ``ac.attention`` (or ``ac.attention_grad``, a tile grid) divides its probabilities by
    their row's sum (its optional ``normalized``: softmax; false: ``exp`` of the scores, sigmoid attention's)."""
    return bool(op.attrs.get("normalized", True))


def lse_dtype(dtype: str) -> str:
    """The log-sum-exp's element type: float32 for 16-bit inputs.  A log-sum-exp is the log of a sum
    of exponentials, often tens in size, so bf16's 8 bits would put it off by up to 0.25, and the
    softmax the backward rebuilds from it (``exp(s - lse)``) by up to 28%; a spec's own
    ``logsumexp`` result is cast to its declared type after (``softmax-fusion``)."""
    return "f32" if dtype in ("f16", "bf16") else dtype


def index_grids(shape: tuple[int, ...]) -> list[np.ndarray]:
    """One broadcastable position array per axis, as ``np.ogrid``."""
    grids = []
    for axis, size in enumerate(shape):
        view = [1] * len(shape)
        view[axis] = size
        grids.append(np.arange(size, dtype=np.int64).reshape(view))
    return grids


def weight_of(op, grids: list[np.ndarray], ctx, at: int = 2) -> np.ndarray | float:
    """The weight region's values (region ``at``) over the scores' positions; 1 without one."""
    if len(op.regions) <= at:
        return 1.0
    return ctx.run_block(op.regions[at], grids)[0]


def expand_heads(x: np.ndarray, kv_repeat: int) -> np.ndarray:
    return x if kv_repeat == 1 else np.repeat(x, kv_repeat, axis=1)


@register
class Attention(OpDef):
    """Fused ``softmax(mask(score(q kᵀ))) v`` with online-softmax semantics."""

    name = "ac.attention"
    num_operands = 3
    attributes = {
        "kv_repeat": "query heads per key/value head (a dimension)",
        "with_lse": "bool: also return the log-sum-exp of the masked scores",
        "with_max": "optional bool: also return each row's max masked score (after the log-sum-exp)",
        "normalized": "optional bool: false: the probabilities are exp(s'), not divided by their row's sum",
        "score_bound": "optional float: no score the region yields exceeds it (log sigmoid's 0): kernels may take it "
        "for every row's max",
    }

    def infer(self, operands, attrs, declared, checker):
        if len(operands) != 3:
            raise TypeCheckError(f"ac.attention: expects q, k, v, got {len(operands)} operands")
        kv_repeat = dim(require_attr(attrs, "kv_repeat", (int, Dim), self.name))
        with_lse = require_attr(attrs, "with_lse", bool, self.name)
        for flag in ("with_max", "normalized"):
            if not isinstance(attrs.get(flag, flag == "normalized"), bool):
                raise TypeCheckError(f"{self.name}: attribute '{flag}' is a bool")
        if not isinstance(attrs.get("score_bound", 0.0), float):
            raise TypeCheckError(f"{self.name}: attribute 'score_bound' is a float")
        return attention_types(*operands, kv_repeat, with_lse, checker, self.name, attrs.get("with_max", False))

    def verify_regions(self, op) -> None:
        rank = op.results[0].type.rank
        scores = score_dtype(promote([op.operands[0].type, op.operands[1].type]))
        index = TensorType((), "i64")
        expected = [
            [index] * rank + [TensorType((), scores)],
            [index] * rank,
            [index] * rank,
        ]
        yields = [TensorType((), scores), TensorType((), BOOL_DTYPE), TensorType((), scores)]
        if len(op.regions) not in (2, 3):
            raise TypeCheckError("ac.attention: needs a score region, a mask region and optionally a weight region")
        for which, region, args, result in zip(("score", "mask", "weight"), op.regions, expected, yields):
            if [a.type for a in region.args] != args:
                shown = ", ".join(map(str, args))
                raise TypeCheckError(f"ac.attention: the {which} region takes ({shown})")
            yielded = [v.type for v in region.ops[-1].operands]
            if len(yielded) != 1 or yielded[0].rank != 0 or yielded[0].dtype != result.dtype:
                raise TypeCheckError(f"ac.attention: the {which} region must yield one {result}")

    def evaluate(self, op, args, ctx):
        q, k, v = args
        n_rep = dim(op.attrs["kv_repeat"]).evaluate(ctx.env)
        k, v = expand_heads(k, n_rep), expand_heads(v, n_rep)
        scores = np.matmul(q, np.swapaxes(k, -1, -2))
        grids = index_grids(scores.shape)
        scored = ctx.run_block(op.regions[0], [*grids, scores])[0]
        visible = ctx.run_block(op.regions[1], grids)[0]
        with np.errstate(all="ignore"):
            masked = np.where(visible, np.broadcast_to(scored, scores.shape), -np.inf)
            m = safe_max(masked, -1)
            p = np.exp(masked - m)
            total = np.sum(p, axis=-1, keepdims=True)
            out = np.matmul(p * weight_of(op, grids, ctx), v)
            if normalized(op):
                out = out / np.where(total == 0.0, 1.0, total)
            else:  # exp(s') itself, exp(s' - m) exp(m) (an empty row: m is 0, p is 0)
                out = out * np.exp(m)
            results = [out]
            if op.attrs["with_lse"]:
                results.append(np.squeeze(m + np.log(total), axis=-1))
            if with_max(op):
                results.append(np.max(masked, axis=-1, initial=-np.inf))
        return results


def lse_type(attn: Op) -> TensorType:
    """The log-sum-exp result type of an ``ac.attention`` (whether it returns one or not)."""
    q, k, v = (x.type for x in attn.operands)
    return attention_types(q, k, v, dim(attn.attrs["kv_repeat"]), True, Checker(), attn.name)[1]


def add_lse(attn: Op) -> Value:
    """Make ``attn`` (an ``ac.attention``) return its log-sum-exp, after its output and before a row
    max (``with_max``); give that result."""
    if not attn.attrs["with_lse"]:
        attn.attrs["with_lse"] = True
        attn.results.insert(1, Value(lse_type(attn), "lse", attn))
    return attn.results[1]
