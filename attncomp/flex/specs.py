"""The spec of a FlexAttention call: its modifications' expressions (:mod:`attncomp.flex.recording`)
as attncomp's DSL, compiled once per expression, tensor types and constants.

The spec computes what FlexAttention defines::

    score = (q @ k.mT) * scale            # scale E ** -0.5 by default; k's heads repeated for each group
    score = score_mod(score, b, h, q_idx, kv_idx)
    score = where(mask_mod(b, h, q_idx, kv_idx), score, -inf)
    out = softmax(score) @ v              # and logsumexp(score), max(score), where asked

so softmax-fusion makes it one fused attention, flash-tiling tiles it and mask-elimination reads
``mask_mod``'s expression itself to skip, unmask or mask each tile: no block mask is ever computed.
The tensors the modifications read are the spec's arguments after ``q``, ``k`` and ``v``, each
with sizes of its own (``C0_0``, ``C0_1``, ... for the first); an index out of their range is
refused before any kernel runs, as every gather's is (docs/compiling.md).
"""

# Dimension names such as ac.floating["B", "H"] are sizes, not forward references.
# ruff: noqa: F821

import inspect
import operator
from typing import Any

import attncomp as ac
from attncomp.flex.recording import const

#: torch's types of a captured tensor -> the DSL's
TYPES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "float64": "f64", "int32": "i32", "int64": "i64"}
TYPES["bool"] = "bool_"


#: an expression's operations (recording.OPS) as the DSL computes them
DSL = {
    "add": operator.add, "sub": operator.sub, "mul": operator.mul, "truediv": operator.truediv,
    "floordiv": operator.floordiv, "mod": operator.mod, "pow": operator.pow, "lt": operator.lt, "le": operator.le,
    "gt": operator.gt, "ge": operator.ge, "eq": operator.eq, "ne": operator.ne, "and": operator.and_,
    "or": operator.or_, "xor": operator.ne, "neg": operator.neg, "abs": ac.abs, "invert": operator.invert,
    "exp": ac.exp, "log": ac.log, "tanh": ac.tanh, "sqrt": ac.sqrt, "rsqrt": ac.rsqrt, "sin": ac.sin, "cos": ac.cos,
    "sigmoid": ac.sigmoid, "maximum": ac.maximum, "minimum": ac.minimum, "where": ac.where,
    "float": lambda x: x.astype(ac.f32), "int": lambda x: x.astype(ac.i32),
}  # fmt: skip


def evaluate(node: tuple, inputs: dict[str, Any], tensors: tuple, memo: dict) -> Any:
    """The DSL value of an expression node: ``inputs`` by name, ``tensors`` by number."""
    if node in memo:
        return memo[node]
    kind = node[0]
    if kind == "input":
        value = inputs[node[1]]
    elif kind == "const":
        value = node[1]
    elif kind == "captured":
        value = tensors[node[1]]
    elif kind in ("and", "or") and const(kind == "and") in node[1:]:  # True & x, False | x: x
        rest = [n for n in node[1:] if n != const(kind == "and")]
        value = evaluate(rest[0], inputs, tensors, memo) if rest else kind == "and"
    else:
        operands = [evaluate(n, inputs, tensors, memo) for n in node[1:]]
        value = operands[0][tuple(operands[1:])] if kind == "index" else DSL[kind](*operands)
    memo[node] = value
    return value


def build(
    score: tuple | None, mask: tuple | None, captured: tuple[tuple[str, int], ...], lse: bool, max_scores: bool = False
) -> ac.Spec:
    """The spec of a call: ``score`` and ``mask`` the modifications' expressions (None: none),
    ``captured`` each captured tensor's (torch type name, number of dimensions), ``lse`` whether it
    returns the log-sum-exp of the scores too, ``max_scores`` each row's max score (after them)."""
    params = [
        inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=ac.floating[dims])
        for name, dims in (("q", ("B", "H", "L", "E")), ("k", ("B", "KV", "S", "E")), ("v", ("B", "KV", "S", "Ev")))
    ]
    for n, (dtype, ndim) in enumerate(captured):
        kind = getattr(ac, TYPES[dtype])
        annotation = kind[tuple(f"C{n}_{d}" for d in range(ndim))] if ndim else kind
        params.append(inspect.Parameter(f"c{n}", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=annotation))
    params.append(inspect.Parameter("scale", inspect.Parameter.KEYWORD_ONLY, default=None))

    def flex_attention(q: Any, k: Any, v: Any, *tensors: Any, scale: float | None = None) -> Any:
        n_rep = q.shape[1] // k.shape[1]
        s = (q @ ac.repeat_kv(k, n_rep).mT) * (q.shape[-1] ** -0.5 if scale is None else scale)
        b, h, i, j = ac.index(s)
        inputs, memo = {"score": s, "b": b, "h": h, "q_idx": i, "kv_idx": j}, {}
        if score is not None:
            s = evaluate(score, inputs, tensors, memo)
        if mask is not None and mask != const(True):
            s = ac.where(evaluate(mask, inputs, tensors, memo), s, -ac.inf)
        out = ac.softmax(s, axis=-1) @ ac.repeat_kv(v, n_rep)
        aux = ([ac.logsumexp(s, axis=-1)] if lse else []) + ([ac.max(s, axis=-1)] if max_scores else [])
        return (out, *aux) if aux else out

    flex_attention.__signature__ = inspect.Signature(params)
    return ac.spec(flex_attention)
