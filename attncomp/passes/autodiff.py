"""autodiff: the backward function of a spec, derived as IR by reverse mode.

The pass replaces the module's function ``@f(args) -> results`` by

    @f_backward(args..., saved..., d_results...) -> (d_arg for each floating argument)

but for the floating arguments named in its option ``without`` (``autodiff{without=bias+slopes}``):
their gradients are neither returned nor computed, as if they were constants (a mask added to
the scores that nothing learns: its gradient would be a ``T x S`` scatter).

``saved`` are, for each fused ``ac.attention`` in program order, its output
and its log-sum-exp as the forward computed them (``save-residuals`` makes the
forward return them: O(T) extra beside the output, never a T x S array).
The backward recomputes every other forward op (projections, rotary
embeddings, norms: cheap next to attention), then sweeps the ops in reverse,
applying the rules of :mod:`attncomp.passes.adjoints`.  A fused attention
becomes one ``ac.attention_grad``, whose gradient region is the score
function differentiated by the same rules: ``d s`` for the raw ``q kᵀ``
element, and a contribution per captured floating tensor the score function
reads (ALiBi slopes, bias tables), with the indices it was read at.  Masks
carry no gradient.  The other passes then tile and classify the backward.
"""

from __future__ import annotations

from dataclasses import dataclass

from attncomp.errors import PipelineError
from attncomp.ir.core import Block, Func, Module, Op, Value
from attncomp.ir.graph import remove_dead_ops
from attncomp.ir.ops.attention import lse_type, normalized
from attncomp.ir.types import TensorType, is_float
from attncomp.passes.adjoints import NO_GRADIENT, RULES, Adjoint
from attncomp.passes.base import Pass, register_pass
from attncomp.passes.builder import clone_block


def attention_ops(func: Func) -> list[Op]:
    """The fused attentions whose output and LSE the forward saves, in program order."""
    return [op for op in func.body.ops if op.name == "ac.attention"]


def _is_float(value: Value) -> bool:
    return is_float(value.type.dtype)


def _captured(region: Block) -> list[Value]:
    """Values a region uses but does not define, in first-use order."""
    inner = set(region.args)
    found: list[Value] = []
    for op in region.ops:
        for v in op.operands:
            if v not in inner and v not in found:
                found.append(v)
        inner.update(op.results)
    return found


def active_values(ops: list[Op], seeds: set[Value]) -> set[Value]:
    """Floating values that depend on ``seeds`` through differentiable ops."""
    active = set(seeds)
    for op in ops:
        if op.name in NO_GRADIENT:
            continue
        uses = set(op.operands)
        for region in op.regions:
            uses.update(_captured(region))
        if uses & active:
            active.update(r for r in op.results if _is_float(r))
    return active


class Sweep:
    """Reverse-mode accumulation over one block's ops (the function body or a region)."""

    def __init__(self, ad: Adjoint, mapping: dict[Value, Value], active: set[Value]):
        self.ad = ad
        self.mapping = mapping  # forward value -> its value in the new block
        self.active = active
        self.grads: dict[Value, Value] = {}

    def value(self, v: Value) -> Value:
        return self.mapping.get(v, v)

    def add(self, v: Value, g: Value | None) -> None:
        if g is None or v not in self.active:
            return
        g = self.ad.sum_to(g, v.type)
        self.grads[v] = self.ad.emit("ac.add", self.grads[v], g) if v in self.grads else g

    def outer(self, v: Value, g: Value) -> None:
        """A gradient reaching a value defined outside the block (regions only)."""
        raise PipelineError(f"autodiff: a gradient reached {v}, defined outside the function")

    def outer_gather(self, op: Op, g: Value) -> bool:
        """Handle ``ac.gather`` from a tensor defined outside the block; False: not such a gather."""
        return False

    def run(self, ops: list[Op]) -> None:
        for op in reversed(ops):
            if op.name == "ac.yield" or op.name == "ac.return":
                continue
            gs = [self.grads.get(r) for r in op.results]
            if all(g is None for g in gs) or op.name in NO_GRADIENT:
                continue
            if op.name == "ac.gather" and self.outer_gather(op, gs[0]):
                continue
            if op.name == "ac.attention":
                operand_grads = self.attention(op, gs)
            elif op.name in RULES:
                x = [self.value(v) for v in op.operands]
                y = [self.value(r) for r in op.results]
                operand_grads = RULES[op.name](self.ad, op, x, y, gs)
            else:
                raise PipelineError(f"autodiff: no gradient rule for {op.name}")
            for operand, g in zip(op.operands, operand_grads):
                self.add(operand, g)

    def attention(self, op: Op, gs: list[Value | None]) -> list[Value | None]:
        raise PipelineError("autodiff: ac.attention inside a region")


class RegionSweep(Sweep):
    """Differentiates a score region; gradients of captured tensors become sites."""

    def __init__(self, ad: Adjoint, mapping: dict[Value, Value], active: set[Value], inner: set[Value]):
        super().__init__(ad, mapping, active)
        self.inner = inner
        #: (captured value, contribution, indices)
        self.sites: list[tuple[Value, Value, list[Value]]] = []

    def add(self, v: Value, g: Value | None) -> None:
        if g is not None and v in self.active and v not in self.inner:
            self.sites.append((v, self.ad.cast(g, v.type.dtype), []))
            return
        super().add(v, g)

    def outer_gather(self, op: Op, g: Value) -> bool:
        src = op.operands[0]
        if src in self.inner:
            return False
        if g is not None and src in self.active:
            indices = [self.ad.cast(self.value(i), "i64") for i in op.operands[1:]]
            self.sites.append((src, self.ad.cast(g, src.type.dtype), indices))
        return True


def gradient_region(score: Block, active_outer: set[Value]) -> tuple[Block, list[tuple[Value, TensorType]]]:
    """The derivative of a score region: ``(positions..., s, g) -> (d s, site contributions and indices...)``.

    Returns the region and, per site, the captured value and its gradient's type.
    """
    block = Block()
    mapping: dict[Value, Value] = {}
    for arg in score.args:
        mapping[arg] = block.add_arg(arg.type, arg.name)
    s = score.args[-1]
    g = block.add_arg(s.type, "g")
    ad = Adjoint(block)
    inner: set[Value] = set(score.args)
    body = score.ops[:-1]
    for op in body:
        clone = Op.create(
            op.name,
            [mapping.get(v, v) for v in op.operands],
            [r.type for r in op.results],
            op.attrs,
            loc=op.loc,
            result_names=[r.name for r in op.results],
        )
        block.ops.append(clone)
        mapping.update(zip(op.results, clone.results))
        inner.update(op.results)
    active = active_values(body, {s} | active_outer)
    sweep = RegionSweep(ad, mapping, active, inner)
    (result,) = score.ops[-1].operands
    sweep.grads[result] = g if result.type == g.type else ad.cast(g, result.type.dtype)
    sweep.run(body)
    ds = sweep.grads.get(s) or ad.like(0.0, mapping[s])
    yields = [ad.cast(ds, s.type.dtype)]
    sites = []
    for value, contribution, indices in sweep.sites:
        yields += [contribution, *indices]
        sites.append((value, value.type.with_dtype(contribution.type.dtype)))
    ad.yield_(*yields)
    remove_dead_ops(block)
    return block, sites


class FunctionSweep(Sweep):
    """The sweep over the function body; fused attentions read their saved results."""

    def __init__(self, ad: Adjoint, mapping: dict[Value, Value], active: set[Value], saved: dict[Op, list[Value]]):
        super().__init__(ad, mapping, active)
        self.saved = saved

    def attention(self, op: Op, gs: list[Value | None]) -> list[Value | None]:
        out, lse = self.saved[op]
        d_out = gs[0] if gs[0] is not None else self.ad.zeros(out.type)
        # a row max (``with_max``, the last result) passes no gradient, as FlexAttention's max_scores;
        # nor does an unnormalised attention's log-sum-exp (only chunk pairs and residuals return it)
        d_lse = gs[1] if op.attrs["with_lse"] and gs[1] is not None else self.ad.zeros(lse.type)
        score, mask, *weight = op.regions
        grad, sites = gradient_region(score, {v for v in _captured(score) if v in self.active})
        q, k, v = (self.value(x) for x in op.operands)
        declared = [q.type, k.type, v.type] + [t for _, t in sites]
        # the weight (dropout's) reads no floating argument (softmax-fusion): it has no gradient
        regions = [clone_block(score), clone_block(mask), grad, *(clone_block(w) for w in weight)]
        _rebind(regions, self.mapping)
        grads = self.ad.op(
            "ac.attention_grad",
            [q, k, v, out, lse, self.ad.cast(d_out, out.type.dtype), self.ad.cast(d_lse, lse.type.dtype)],
            {"kv_repeat": op.attrs["kv_repeat"], **({} if normalized(op) else {"normalized": False})},
            declared,
            regions,
            names=["d_q", "d_k", "d_v"] + [f"d_{value.name or 'site'}" for value, _ in sites],
        )
        for (value, _), g in zip(sites, grads.results[3:]):
            self.add(value, g)
        return list(grads.results[:3])


def _rebind(regions: list[Block], mapping: dict[Value, Value]) -> None:
    """Make region ops use the backward function's values for the outside values they read."""
    for region in regions:
        for op in region.walk():
            op.operands = [mapping.get(v, v) for v in op.operands]


def backward_function(fwd: Func, without: frozenset[str] = frozenset()) -> Func:
    block = Block()
    mapping: dict[Value, Value] = {}
    for arg in fwd.args:
        mapping[arg] = block.add_arg(arg.type, arg.name)
    saved: dict[Op, list[Value]] = {}
    for attn in attention_ops(fwd):
        out = block.add_arg(attn.results[0].type, f"saved_{attn.results[0].name or 'out'}")
        lse = block.add_arg(lse_type(attn), "saved_lse")
        saved[attn] = [out, lse]
    results = fwd.results
    cotangents = [block.add_arg(r.type, f"d_{r.name or 'result'}") for r in results]
    ad = Adjoint(block)
    body = fwd.body.ops[:-1]
    for op in body:
        if op in saved:
            mapping.update(zip(op.results, saved[op]))
            continue
        if op.regions:
            raise PipelineError(f"autodiff: cannot differentiate {op.name}; run it before flash-tiling")
        clone = Op.create(
            op.name,
            [mapping[v] for v in op.operands],
            [r.type for r in op.results],
            op.attrs,
            loc=op.loc,
            result_names=[r.name for r in op.results],
        )
        block.ops.append(clone)
        mapping.update(zip(op.results, clone.results))
    floating = [a for a in fwd.args if _is_float(a)]
    unknown = without - {a.name for a in floating}
    if unknown:
        raise PipelineError(
            f"autodiff: without={'+'.join(sorted(unknown))} names no floating argument of @{fwd.name} "
            f"({', '.join(a.name for a in floating)})"
        )
    float_args = [a for a in floating if a.name not in without]
    active = active_values(body, set(float_args))
    sweep = FunctionSweep(ad, mapping, active, saved)
    for result, cotangent in zip(results, cotangents):
        sweep.add(result, cotangent)
    sweep.run(body)
    grads = []
    for arg in float_args:
        g = sweep.grads.get(arg)
        grads.append(g if g is not None else ad.zeros(mapping[arg].type))
    for arg, g in zip(float_args, grads):
        if isinstance(g.owner, Op):  # not an argument passed straight through
            g.name = f"d_{arg.name}"
    ad.op("ac.return", grads)
    func = Func(f"{fwd.name}_backward", block, dict(fwd.attrs))
    func.attrs.pop("residuals", None)
    remove_dead_ops(block)
    return func


@register_pass
@dataclass
class Autodiff(Pass):
    name = "autodiff"
    summary = "replace the function by its backward (reverse-mode gradients as IR)"
    #: floating arguments that get no gradient, by name, joined by ``+``
    without: str = ""

    def run(self, module: Module, remarks: list[str]) -> None:
        fwd = module.main
        if any(op.name == "ac.tile_grid" for op in fwd.body.ops):
            raise PipelineError("autodiff: the function is already tiled; run autodiff before flash-tiling")
        if "cached_length" in fwd.attrs:
            raise PipelineError("autodiff: a decoder step has no backward")
        module.funcs[0] = backward_function(fwd, frozenset(filter(None, self.without.split("+"))))
