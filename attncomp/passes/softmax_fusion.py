"""softmax-fusion: ``softmax(f(q kᵀ)) v`` becomes one ``ac.attention`` op.

Recognised shapes of the same computation:
- softmax written as ``ac.softmax`` or spelled out
  (``e = exp(s - max(s)); e / sum(e)``, with or without the max);
- the scale applied to q, to k, or to the scores (a 0-d factor on q or k is
  moved into the score function);
- keys and values through ``ac.repeat_kv`` (kept as the index mapping
  ``h // kv_repeat`` instead of a copy);
- ``ac.logsumexp`` of the same masked scores, which becomes a second result, and their
  ``ac.max`` along the keys, which becomes the last (no gradient flows through it).

The score function (everything elementwise between ``q @ kᵀ`` and the
softmax) and the mask (the outermost ``where(cond, s, -inf)`` conditions,
and-ed) become the op's two regions, which see one score element at a time;
a weight the probabilities are multiplied by before ``@ v`` (``ac.dropout``'s) becomes a
third.  When the probabilities are used for anything but ``p @ v`` nothing is fused
and a remark says why.
"""

from __future__ import annotations

from dataclasses import dataclass

import networkx as nx

from attncomp.ir.core import Block, Func, Location, Module, Op, Value
from attncomp.ir.dims import dim
from attncomp.ir.graph import remove_dead_ops, use_def_graph, users
from attncomp.ir.ops import Checker
from attncomp.ir.ops.attention import attention_types
from attncomp.ir.printer import Namer
from attncomp.ir.types import TensorType, category, is_float, score_dtype, wider
from attncomp.passes.base import Pass, register_pass
from attncomp.passes.builder import Builder
from attncomp.passes.patterns import (
    ELEMENTWISE,
    constant_value,
    is_neg_inf,
    last_axis_reduction,
    producer,
    sigmoid_input,
    softmax_division,
)
from attncomp.passes.rewrite import replace_uses

INDEX_NAMES = {2: ["i", "j"], 3: ["b", "i", "j"], 4: ["b", "h", "i", "j"]}


class NotFusable(Exception):
    """Why a softmax could not be fused (becomes a remark)."""


class NotAttention(NotFusable):
    """No single ``q @ kᵀ`` product feeds the probabilities (for a logistic function: no attention)."""


def _insert_before(block: Block, anchor: Op, new_ops: list[Op]) -> None:
    at = block.ops.index(anchor)
    block.ops[at:at] = new_ops


# spelled-out softmax ------------------------------------------------------------
def canonicalize_softmax(block: Block) -> None:
    """Rewrite ``exp(x - max(x)) / sum(...)`` (or ``exp(x) / sum(exp(x))``) to ``ac.softmax``."""
    for op in list(block.ops):
        e = softmax_division(op)
        if e is None:
            continue
        x = producer(e).operands[0]
        sub = producer(x, "ac.sub")
        if sub is not None and last_axis_reduction(sub.operands[1], "max") is sub.operands[0]:
            x = sub.operands[0]
        if x.type.shape != op.result.type.shape or x.type.dtype != op.result.type.dtype:
            continue
        softmax = Op.create(
            "ac.softmax", [x], [op.result.type], {"axis": x.type.rank - 1}, result_names=[op.result.name]
        )
        _insert_before(block, op, [softmax])
        replace_uses(block, {op.result: softmax.result})
        op.result.name = None


# the score and mask regions -------------------------------------------------------
class RegionBuilder:
    """Builds a region computing one score element from graph values.

    ``value(v)`` gives the region-local scalar for graph value ``v`` of a
    shape that broadcasts against the scores: positions become the region's
    index arguments, elementwise ops and gathers are cloned, 0-d values are
    used from outside, and any other tensor is read element-wise by a gather.
    """

    def __init__(self, score_type: TensorType, with_score: bool):
        self.rank = score_type.rank
        self.block = Block()
        names = INDEX_NAMES.get(self.rank, [f"x{k}" for k in range(self.rank)])
        self.index = [self.block.add_arg(TensorType((), "i64"), n) for n in names]
        self.score = self.block.add_arg(TensorType((), score_type.dtype), "s") if with_score else None
        self.memo: dict[Value, Value] = {}
        self.builder = Builder(self.block)

    def emit(self, name: str, operands: list[Value], attrs: dict | None = None, loc: Location | None = None) -> Value:
        return self.builder.op(name, operands, attrs, loc=loc).result

    def cast(self, value: Value, dtype: str) -> Value:
        return self.builder.cast(value, dtype)

    def zero_index(self) -> Value:
        return self.builder.const(0, "i64")

    def value(self, v: Value) -> Value:
        if v in self.memo:
            return self.memo[v]
        op = producer(v)
        offset = self.rank - v.type.rank
        if v.type.rank == 0:
            result = v
        elif op is not None and op.name == "ac.iota":
            result = self.index[op.attrs["axis"] % v.type.rank + offset]
        elif op is not None and op.name in ELEMENTWISE:
            result = self.clone_elementwise(op)
        elif op is not None and op.name == "ac.gather":
            src, *indices = op.operands
            result = self.emit("ac.gather", [src] + [self.value(i) for i in indices], loc=op.loc)
        else:
            indices = [
                self.zero_index() if d.is_const and d.value == 1 else self.index[axis + offset]
                for axis, d in enumerate(v.type.shape)
            ]
            result = self.emit("ac.gather", [v] + indices)
        self.memo[v] = result
        return result

    def clone_elementwise(self, op: Op) -> Value:
        want = self.computed_in(op.result.type.dtype)
        operands = [self.value(x) for x in op.operands]
        if op.name not in ("ac.cmp", "ac.cast"):
            # In the graph a rank > 0 operand decides the width; scalars must agree explicitly.
            first = 1 if op.name == "ac.where" else 0
            operands[first:] = [
                self.cast(x, want) if category(x.type.dtype) == category(want) else x for x in operands[first:]
            ]
        if op.name == "ac.cast":
            return self.cast(operands[0], want)
        return self.emit(op.name, operands, op.attrs)

    def computed_in(self, dtype: str) -> str:
        """A float computed in the region is computed in the score type or wider: the graph's
        narrower roundings (a bf16 product, a float32 bias cast to bf16) are not repeated."""
        if self.score is None or not is_float(dtype):
            return dtype
        return wider(dtype, self.score.type.dtype)

    def finish(self, result: Value, dtype: str) -> Block:
        self.block.ops.append(Op.create("ac.yield", [self.cast(result, dtype)], []))
        return self.block


# fusion ------------------------------------------------------------------------------
@dataclass
class Match:
    #: the masked scores whose softmax (or logistic function) the probabilities are
    scores: Value
    pv: Op
    q: Value
    k: Value
    v: Value
    kv_repeat: object
    k_is_transposed: bool
    qk: Op
    q_scale: list[Value]
    conds: list[Value]
    score_input: Value
    #: the weight the probabilities are multiplied by before ``@ v`` (dropout's), or None
    weight: Value | None = None
    #: False: sigmoid attention's probabilities, not divided by their row's sum
    normalized: bool = True


def _peel_mask(scores: Value) -> tuple[list[tuple[Value, bool]], Value]:
    """Outermost ``where(c, x, -inf)`` layers: [(cond, negate)], inner value."""
    conds = []
    while (op := producer(scores, "ac.where")) is not None:
        cond, a, b = op.operands
        if is_neg_inf(b) and a.type.shape == scores.type.shape:
            conds.append((cond, False))
            scores = a
        elif is_neg_inf(a) and b.type.shape == scores.type.shape:
            conds.append((cond, True))
            scores = b
        else:
            break
    return conds, scores


def _find_qk(x: Value, score_shape) -> Op:
    """The one ``q @ kᵀ`` matmul that the scores are elementwise functions of."""
    found, seen, stack = [], set(), [x]
    while stack:
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        op = producer(v)
        if op is None:
            continue
        if op.name == "ac.matmul" and v.type.shape == score_shape:
            found.append(op)
        elif op.name in ELEMENTWISE:
            stack.extend(op.operands)
    if len(found) != 1:
        raise (NotFusable if found else NotAttention)(
            "no single q @ kᵀ product feeds the scores" if not found else "the scores add up several matmul products"
        )
    return found[0]


def _peel_scale(value: Value) -> tuple[Value, list[Value]]:
    """``x * c`` or ``x / c`` with a 0-d ``c`` -> (x, [c or 1/c factors])."""
    factors = []
    while (op := producer(value)) is not None and op.name in ("ac.mul", "ac.div"):
        a, b = op.operands
        if b.type.rank == 0 and a.type == value.type:
            factors.append((b, op.name == "ac.div"))
            value = a
        elif op.name == "ac.mul" and a.type.rank == 0 and b.type == value.type:
            factors.append((a, False))
            value = b
        else:
            break
    return value, factors


def match_attention(func: Func, softmax: Op, use_table: dict[Value, list[Op]], namer: Namer) -> Match:
    p = softmax.result
    rank = p.type.rank
    if softmax.attrs["axis"] != rank - 1 or rank < 2:
        raise NotFusable(f"the softmax of %{namer[p]} is not over the last axis")
    uses = use_table.get(p, [])
    if p in func.results:
        raise NotFusable(f"the probabilities %{namer[p]} are also returned")
    weight = None
    if len(uses) == 1 and uses[0].name == "ac.mul":
        weight, uses = _weighted(func, p, uses[0], use_table, namer)
    if len(uses) != 1 or uses[0].name != "ac.matmul" or uses[0].operands[0] is not (weight or p):
        raise NotFusable(f"the probabilities %{namer[p]} are used by something other than p @ v")
    conds, x = _peel_mask(softmax.operands[0])
    qk = _find_qk(x, p.type.shape)
    factor = None if weight is None else _factor(producer(weight), p)
    return _complete(func, uses[0], softmax.operands[0], conds, x, qk, namer, factor)


@dataclass
class SigmoidWeights:
    """The weights of ``p @ v`` as a (masked) logistic function of some scores."""

    #: the weights and each ``where(c, ., 0)`` layer around the logistic function, outermost first
    layers: list[Value]
    #: the zero layers' conditions (each with whether it is negated)
    conds: list[tuple[Value, bool]]
    #: the logistic function's input
    x: Value


def sigmoid_candidate(pv: Op) -> SigmoidWeights | None:
    """``p @ v`` whose ``p`` is a logistic function of the scores, masked by ``where(c, p, 0)`` layers or
    inside (``sigmoid(where(c, s, -inf))``); None when ``p`` is no logistic function."""
    if pv.name != "ac.matmul" or pv.operands[0].type.rank < 2:
        return None
    layers, conds = [pv.operands[0]], []
    while (x := sigmoid_input(layers[-1])) is None:
        op, p = producer(layers[-1], "ac.where"), layers[-1]
        if op is None:
            return None
        cond, a, b = op.operands
        if constant_value(b) == 0.0 and a.type.shape == p.type.shape:
            conds.append((cond, False))
            layers.append(a)
        elif constant_value(a) == 0.0 and b.type.shape == p.type.shape:
            conds.append((cond, True))
            layers.append(b)
        else:
            return None
    return SigmoidWeights(layers, conds, x)


def match_sigmoid_attention(
    func: Func, pv: Op, found: SigmoidWeights, use_table: dict[Value, list[Op]], namer: Namer
) -> Match:
    """Sigmoid attention, ``where(mask, sigmoid(f(q kᵀ)), 0) @ v``: an unnormalised ``ac.attention``
    (``normalized = false``) whose score function is ``log sigmoid(f(s))``.  Raises :class:`NotAttention`
    where no single ``q @ kᵀ`` feeds ``p`` (a logistic function of something else, a gate), and
    :class:`NotFusable` where the attention cannot be fused."""
    conds, inner = _peel_mask(found.x)
    qk = _find_qk(inner, found.layers[-1].type.shape)
    for value in found.layers:  # the weights and each masked layer are read by ``@ v`` alone
        if value in func.results or len(use_table.get(value, [])) != 1:
            raise NotFusable(f"the sigmoid probabilities %{namer[value]} are used by something other than p @ v")
    return _complete(func, pv, found.x, found.conds + conds, inner, qk, namer, None, normalized=False)


def _complete(
    func: Func,
    pv: Op,
    scores: Value,
    conds: list[tuple[Value, bool]],
    x: Value,
    qk: Op,
    namer: Namer,
    weight: Value | None,
    normalized: bool = True,
) -> Match:
    """The match of ``p @ v`` (``pv``) whose probabilities come from ``scores`` (masked by ``conds``,
    ``x`` inside them), elementwise functions of the product ``qk``."""
    block_ops = func.body.ops
    graph = use_def_graph(func.body)
    # Everything between qk and the probabilities must be elementwise in the scores.
    stack, seen = [x], set()
    while stack:
        v = stack.pop()
        op = producer(v)
        if v in seen or op is None or op is qk:
            continue
        seen.add(v)
        if op.name in ELEMENTWISE:
            stack.extend(op.operands)
        elif op in block_ops and qk in nx.ancestors(graph, op):
            raise NotFusable(f"the scores pass through {op.name} (%{namer[v]}) before the softmax")
    for cond, _ in conds:
        cond_op = producer(cond)
        if cond_op is not None and (cond_op is qk or qk in nx.ancestors(graph, cond_op)):
            raise NotFusable("the mask depends on the scores")
    q, q_scale = _peel_scale(qk.operands[0])
    k_t, k_scale = _peel_scale(qk.operands[1])
    k, k_is_transposed = k_t, True
    t_op = producer(k_t, "ac.transpose")
    if t_op is not None and t_op.attrs["perm"] == _swap_last(k_t.type.rank):
        k, k_is_transposed = t_op.operands[0], False
        k, inner_scale = _peel_scale(k)
        k_scale += inner_scale
    v = pv.operands[1]
    kv_repeat: object = 1
    rk, rv = producer(k, "ac.repeat_kv"), producer(v, "ac.repeat_kv")
    if rk is not None and rv is not None and dim(rk.attrs["n_rep"]) == dim(rv.attrs["n_rep"]):
        k, v, kv_repeat = rk.operands[0], rv.operands[0], rk.attrs["n_rep"]
    return Match(scores, pv, q, k, v, kv_repeat, k_is_transposed, qk, q_scale + k_scale, conds, x, weight, normalized)


def _factor(mul: Op, p: Value) -> Value:
    """The weight ``w`` of ``p * w``."""
    return mul.operands[1] if mul.operands[0] is p else mul.operands[0]


def _weighted(func: Func, p: Value, mul: Op, use_table: dict[Value, list[Op]], namer: Namer) -> tuple[Value, list[Op]]:
    """``p * w`` with a weight ``w`` of the positions (attention dropout: ``ac.dropout``) -> (``p * w``,
    its users).  The weight may read integer and boolean arguments (a seed), constants and sizes, not
    the scores nor a floating argument: its gradient is not computed."""
    w = _factor(mul, p)
    if mul.result.type.shape != p.type.shape or not is_float(w.type.dtype):
        raise NotFusable(f"the probabilities %{namer[p]} are multiplied by something other than a weight")
    graph = use_def_graph(func.body)
    inputs = set(func.args)
    stack, seen = [w], set()
    while stack:
        value = stack.pop()
        if value in seen:
            continue
        seen.add(value)
        if value.type.rank == 0 and not is_float(value.type.dtype) and value not in inputs:
            continue  # an integer computed once outside (``seed[0]`` of a seed tensor): the region uses it as it is
        if value in inputs and is_float(value.type.dtype):
            raise NotFusable(f"the weight of the probabilities %{namer[p]} reads the floating argument %{namer[value]}")
        op = producer(value)
        if op is None:
            continue
        if op.name not in ELEMENTWISE and op.name not in ("ac.iota", "ac.constant", "ac.dim", "ac.gather"):
            raise NotFusable(f"the weight of the probabilities %{namer[p]} passes through {op.name}")
        if op is producer(p) or producer(p) in nx.ancestors(graph, op):
            raise NotFusable(f"the weight of the probabilities %{namer[p]} depends on the scores")
        stack.extend(op.operands)
    if mul.result in func.results:
        raise NotFusable(f"the weighted probabilities %{namer[mul.result]} are also returned")
    return mul.result, use_table.get(mul.result, [])


def _swap_last(rank: int) -> list[int]:
    perm = list(range(rank))
    perm[-2], perm[-1] = perm[-1], perm[-2]
    return perm


def build_regions(m: Match) -> list[Block]:
    score_type = m.qk.result.type.with_dtype(score_dtype(m.qk.result.type.dtype))
    score = RegionBuilder(score_type, with_score=True)
    raw = score.score
    for factor, divide in m.q_scale:
        f = score.cast(factor, score_type.dtype)
        raw = score.emit("ac.div" if divide else "ac.mul", [raw, f])
    score.memo[m.qk.result] = raw
    x = score.value(m.score_input)
    if not m.normalized:  # exp of the score function is the logistic function of the scores
        x = log_sigmoid(score, score.cast(x, score_type.dtype), score_type.dtype)
    score_block = score.finish(x, score_type.dtype)

    mask = RegionBuilder(score_type, with_score=False)
    visible = None
    for cond, negate in m.conds:
        c = mask.value(cond)
        if negate:
            c = mask.emit("ac.not", [c])
        visible = c if visible is None else mask.emit("ac.and", [visible, c])
    if visible is None:
        visible = mask.builder.const(True, "i1")
    regions = [score_block, mask.finish(visible, "i1")]
    if m.weight is not None:
        weight = RegionBuilder(score_type, with_score=False)
        regions.append(weight.finish(weight.value(m.weight), score_type.dtype))
    return regions


def log_sigmoid(region: RegionBuilder, x: Value, dtype: str) -> Value:
    """``log sigmoid(x) = min(x, 0) - log(1 + exp(-|x|))``, with ``-|x|`` and ``min(x, 0)`` chosen by
    ``x >= 0`` (as ``ac.sigmoid`` chooses): finite for every finite ``x``, and its derivative at 0
    the branch's, one half."""
    zero = region.builder.const(0.0, dtype)
    right = region.emit("ac.cmp", [x, zero], {"pred": "ge"})
    tail = region.emit("ac.exp", [region.emit("ac.where", [right, region.emit("ac.neg", [x]), x])])
    one_plus = region.emit("ac.add", [region.builder.const(1.0, dtype), tail])
    return region.emit("ac.sub", [region.emit("ac.where", [right, zero, x]), region.emit("ac.log", [one_plus])])


def fuse(func: Func, m: Match, use_table: dict[Value, list[Op]]) -> None:
    block = func.body
    new_ops: list[Op] = []
    k = m.k
    if m.k_is_transposed:
        swap = _swap_last(k.type.rank)
        t = Op.create("ac.transpose", [k], [k.type.with_shape([k.type.shape[p] for p in swap])], {"perm": swap})
        new_ops.append(t)
        k = t.result
    scores, last = m.scores, m.scores.type.rank - 1
    readers = use_table.get(scores, []) if m.normalized else []
    lse_ops = [op for op in readers if op.name == "ac.logsumexp" and op.attrs["axis"] == last]
    row_max = [op for op in readers if op.name == "ac.reduce" and op.attrs["kind"] == "max"]
    max_ops = [op for op in row_max if list(op.attrs["axes"]) == [last]]
    attrs = {"kv_repeat": m.kv_repeat, "with_lse": bool(lse_ops)}
    if max_ops:
        attrs["with_max"] = True
    if not m.normalized:  # log sigmoid is at most 0
        attrs["normalized"] = False
        attrs["score_bound"] = 0.0
    types = attention_types(
        m.q.type, k.type, m.v.type, dim(m.kv_repeat), bool(lse_ops), Checker(), "fusion", bool(max_ops)
    )
    result = _attention_result(m.pv, types[0], use_table)
    if types[0] != result.type:
        raise NotFusable(f"the fused result would be {types[0]}, not {m.pv.result.type}")
    names = [result.name] + [ops[0].result.name for ops in (lse_ops, max_ops) if ops]
    attn = Op.create("ac.attention", [m.q, k, m.v], types, attrs, build_regions(m), result_names=names)
    new_ops.append(attn)
    mapping = {result: attn.results[0]}
    result.name = None
    anchor = min([m.pv] + lse_ops + max_ops, key=block.ops.index)
    for ops, fused in ((lse_ops, attn.results[1] if lse_ops else None), (max_ops, attn.results[-1])):
        for op in ops:
            mapping[op.result] = _declared(op, fused, new_ops)
    _insert_before(block, anchor, new_ops)
    replace_uses(block, mapping)


def _declared(op: Op, fused: Value, new_ops: list[Op]) -> Value:
    """A row result of the fused op (its log-sum-exp or max) as ``op`` (the reduction it replaces)
    declared it: kept in float32 (``lse_dtype``) and cast to the declared type, reshaped where it
    keeps its axis."""
    want = op.result.type
    if fused.type.dtype != want.dtype:
        name = None if op.attrs["keepdims"] else op.result.name
        cast = Op.create("ac.cast", [fused], [fused.type.with_dtype(want.dtype)], result_names=[name])
        new_ops.append(cast)
        fused = cast.result
    if op.attrs["keepdims"]:
        reshape = Op.create("ac.reshape", [fused], [want], result_names=[op.result.name])
        new_ops.append(reshape)
        fused = reshape.result
    elif fused.type != want:
        raise NotFusable(f"the {'log-sum-exp' if op.name == 'ac.logsumexp' else 'row max'} has an unexpected shape")
    op.result.name = None
    return fused


def _attention_result(pv: Op, fused: TensorType, use_table: dict[Value, list[Op]]) -> Value:
    """The value the fused op replaces: ``p @ v``, or its cast to the values' type where wider
    probabilities met narrower values (the tracer's ``matmul`` adds that cast)."""
    uses = use_table.get(pv.result, [])
    if pv.result.type != fused and len(uses) == 1 and uses[0].name == "ac.cast":
        cast = uses[0].result
        if cast.type == fused:
            return cast
    return pv.result


def widening_remark(m: Match, namer: Namer) -> str | None:
    """A remark when the spec's graph computes its scores wider than the fused op's score type (a
    float64 tensor met float32 scores): the fused op computes the widened part as the spec says."""
    graph, fused = m.score_input.type.dtype, score_dtype(m.qk.result.type.dtype)
    if not is_float(graph) or wider(graph, fused) == fused:
        return None
    return (
        f"softmax-fusion: the scores %{namer[m.score_input]} are {graph}, wider than the attention's score type "
        f"{fused}: the score function computes in {graph} and the scores are rounded to {fused} (cast the "
        f"{graph} tensors that meet the scores to keep them {fused})"
    )


def fuse_sigmoid_attention(func: Func, remarks: list[str]) -> None:
    """Fuse every ``p @ v`` whose ``p`` is a (masked) logistic function of elementwise functions of one
    ``q @ kᵀ`` (a remark where such a ``p`` cannot be fused)."""
    remove_dead_ops(func.body)
    namer = Namer.for_func(func)
    for pv in [op for op in func.body.ops if op.name == "ac.matmul"]:
        found = sigmoid_candidate(pv)
        if found is None or pv not in func.body.ops:
            continue
        use_table = users(func.body)
        try:
            m = match_sigmoid_attention(func, pv, found, use_table, namer)
            fuse(func, m, use_table)
        except NotAttention:
            continue
        except NotFusable as why:
            remarks.append(f"softmax-fusion: sigmoid attention not fused: {why}")


@register_pass
@dataclass
class SoftmaxFusion(Pass):
    name = "softmax-fusion"
    summary = "fuse softmax(f(q kᵀ)) v (and its log-sum-exp) into ac.attention"
    #: also fuse sigmoid attention, ``where(mask, sigmoid(f(q kᵀ)), 0) @ v``, into an unnormalised
    #: ``ac.attention`` (``normalized = false``)
    sigmoid: bool = True

    def run(self, module: Module, remarks: list[str]) -> None:
        for func in module.funcs:
            canonicalize_softmax(func.body)
            remove_dead_ops(func.body)  # a spelled-out softmax's own max: not a row max the spec returns
            namer = Namer.for_func(func)
            for op in [op for op in func.body.ops if op.name == "ac.softmax"]:
                use_table = users(func.body)
                try:
                    m = match_attention(func, op, use_table, namer)
                    fuse(func, m, use_table)
                    if (remark := widening_remark(m, namer)) is not None:
                        remarks.append(remark)
                except NotFusable as why:
                    remarks.append(f"softmax-fusion: not fused: {why}")
            if self.sigmoid:
                fuse_sigmoid_attention(func, remarks)
            remove_dead_ops(func.body)
