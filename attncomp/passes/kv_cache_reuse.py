"""kv-cache-reuse: a whole-sequence spec becomes an incremental decoder.

After softmax-fusion, the fused ``ac.attention`` names q, k and v.  The pass

- checks that everything computing k and v is position-wise along the key
  axis (projections, rotary embeddings, norms over features): each new
  token's key depends on that token only, so keys are computed for new
  tokens and earlier ones are read from the cache; otherwise it refuses,
  naming the op;
- adds two arguments, ``k_cache`` and ``v_cache``, preallocated with
  ``N_max`` positions (GQA caches hold only the key/value heads), and feeds
  the attention ``ac.cache_append(cache, new)``: the ``N_cached`` cached
  entries followed by the new ones;
- makes positions absolute: every ``ac.iota`` along a new-token axis, and
  the query index ``i`` of the score and mask functions, are offset by
  ``N_cached``, so causal masks (bottom-right aligned), windows, ALiBi and
  rotary embeddings stay right with the spec unchanged;
- returns the new keys and values after the spec's results, so the caller
  can keep its cache whatever the backend.

Where the values are the keys' first features (``v = k[..., :E]``: MLA's
absorbed decoding, whose keys are a latent of 576 features and values its
first 512), one cache holds both: the attention reads its values as
``ac.slice`` of the appended keys, and only the new keys are returned
(``cache_results = 1``).

With ``cache=f8e4m3`` (or ``f8e5m2``) the caches hold 8-bit codes, and beside
each a float32 argument ``k_scale`` (``v_scale``) of one scale per (token,
head) row: ``ac.cache_append`` quantises the new entries as it appends them
and gives every entry dequantised, in the keys' type (``ir.quantized``).

``N_cached`` is bound by the caller (the decoder's length), ``N_max`` by the
cache arrays' size.
"""

from __future__ import annotations

from dataclasses import dataclass

from attncomp.errors import PipelineError
from attncomp.ir.core import Func, Module, Op, Value
from attncomp.ir.dims import Dim, dim
from attncomp.ir.graph import remove_dead_ops
from attncomp.ir.printer import Namer
from attncomp.ir.types import CACHE_DTYPES, TensorType
from attncomp.passes.base import Pass, register_pass
from attncomp.passes.builder import Builder
from attncomp.passes.patterns import producer
from attncomp.passes.rewrite import replace_uses

CACHED, CAPACITY = "N_cached", "N_max"


class NotCacheable(PipelineError):
    """The spec cannot be decoded incrementally; the message names the op."""


def _product(dims) -> Dim:
    total = dim(1)
    for d in dims:
        total = total * d
    return total


def mixes_positions(op: Op, seq: Dim) -> str | None:
    """Why ``op`` combines values at different positions along ``seq``, or None."""
    name, operands = op.name, op.operands

    def axis_dims(value: Value, axes) -> list[Dim]:
        return [value.type.shape[a % value.type.rank] for a in axes]

    if name == "ac.matmul":
        a, b = operands
        if a.type.shape[-1] == seq or b.type.shape[-2] == seq:
            return "it contracts over the key axis"
    elif name == "ac.reduce":
        if seq in axis_dims(operands[0], op.attrs["axes"]):
            return "it reduces over the key axis"
    elif name in ("ac.softmax", "ac.logsumexp", "ac.slice", "ac.concat"):
        if any(seq in axis_dims(v, [op.attrs["axis"]]) for v in operands):
            return f"{name} runs along the key axis"
    elif name == "ac.reshape":
        src, out = operands[0].type.shape, op.results[0].type.shape
        if seq in src:
            if seq not in out or _product(src[: src.index(seq)]) != _product(out[: out.index(seq)]):
                return "it merges or splits the key axis"
    elif name == "ac.gather":
        if seq in operands[0].type.shape:
            return "it gathers along the key axis"
    elif name in ("ac.attention", "ac.cache_append"):
        return f"{name} cannot be recomputed per token"
    return None


def find_mixing(func: Func, roots: list[Value], axes: list[Dim]) -> tuple[str, Op, Dim, str] | None:
    """The first op on the paths to ``roots`` that mixes positions along one of ``axes``:
    (its result's name, the op, the axis, why), or None."""
    namer = Namer.for_func(func)
    stack, seen = list(roots), set()
    while stack:
        value = stack.pop()
        op = producer(value)
        if value in seen or op is None:
            continue
        seen.add(value)
        for axis in axes:
            why = mixes_positions(op, axis)
            if why is not None:
                return namer[value], op, axis, why
        stack.extend(op.operands)
    return None


def check_position_wise(func: Func, roots: list[Value], seq: Dim) -> None:
    found = find_mixing(func, roots, [seq])
    if found is not None:
        name, op, _, why = found
        raise NotCacheable(
            f"kv-cache-reuse: not applied: %{name} = {op.name} is on the key/value path "
            f"and {why} ({seq}), so keys cannot be computed for new tokens alone"
        )


def fresh_dim(func: Func, base: str) -> str:
    used = {d for a in func.args for s in a.type.shape for d in s.symbols()}
    name, k = base, 0
    while name in used:
        k += 1
        name = f"{base}{k}"
    return name


def offset_iotas(func: Func, seq_dims: set[Dim], cached: Dim) -> None:
    """Positions along the axes ``seq_dims`` become absolute: iota + ``cached`` (N_cached)."""
    block = func.body
    for op in list(block.ops):
        if op.name != "ac.iota":
            continue
        size = op.results[0].type.shape[op.attrs["axis"] % op.results[0].type.rank]
        if size not in seq_dims:
            continue
        builder = Builder(block, block.ops.index(op) + 1)
        shifted = builder.emit("ac.add", op.results[0], builder.dim(cached))
        replace_uses(block, {op.results[0]: shifted})
        shifted.owner.operands[0] = op.results[0]  # the add itself still reads the raw positions
        shifted.name, op.results[0].name = op.results[0].name, None


def offset_region_index(attn: Op, position: int, offset: Dim) -> None:
    """Every region of ``attn`` sees its index argument ``position`` plus ``offset``."""
    for region in attn.regions:
        index = region.args[position]
        builder = Builder(region, 0)
        absolute = builder.emit("ac.add", index, builder.dim(offset))
        replace_uses(region, {index: absolute})
        absolute.owner.operands[0] = index


def _region_reads_sequence_inputs(func: Func, attn: Op, seq_dims: set[Dim]) -> str | None:
    namer = Namer.for_func(func)
    for region in attn.regions:
        for op in region.walk():
            if op.name == "ac.gather":
                src = op.operands[0]
                if any(d in seq_dims for d in src.type.shape):
                    return (
                        f"kv-cache-reuse: not applied: the score or mask function reads %{namer[src]} "
                        "at sequence positions; a decoder would need its cached history"
                    )
    return None


def value_slice(k: Value, v: Value) -> Op | None:
    """The ``ac.slice`` making ``v`` the first features of ``k`` (MLA's latent: the keys are the whole
    latent, the values its first 512 features), or None.  Then one cache holds both."""
    op = producer(v)
    if op is None or op.name != "ac.slice" or op.operands[0] is not k:
        return None
    attrs = op.attrs
    if attrs.get("axis") % k.type.rank != k.type.rank - 1 or attrs.get("start") != 0 or attrs.get("step", 1) != 1:
        return None
    return op


@register_pass
@dataclass
class KVCacheReuse(Pass):
    name = "kv-cache-reuse"
    summary = "turn a whole-sequence spec into a decoder over a preallocated key/value cache"
    #: the caches' element type: "" (the keys' and values' own) or an 8-bit type with scales
    cache: str = ""

    def run(self, module: Module, remarks: list[str]) -> None:
        if self.cache and self.cache not in CACHE_DTYPES:
            raise PipelineError(
                f"kv-cache-reuse: cache must be one of {', '.join(CACHE_DTYPES)} (or absent), got {self.cache!r}"
            )
        func = module.main
        attns = [op for op in func.body.ops if op.name == "ac.attention"]
        if len(attns) != 1:
            raise NotCacheable(
                f"kv-cache-reuse: needs exactly one fused attention (run softmax-fusion first), found {len(attns)}"
            )
        attn = attns[0]
        q, k, v = attn.operands
        seq_q, seq_k = q.type.shape[-2], k.type.shape[-2]
        seq_dims = {seq_q, seq_k}
        check_position_wise(func, [k, v], seq_k)
        problem = _region_reads_sequence_inputs(func, attn, seq_dims)
        if problem:
            raise NotCacheable(problem)
        cached = Dim.sym(fresh_dim(func, CACHED))
        capacity = Dim.sym(fresh_dim(func, CAPACITY))
        offset_iotas(func, seq_dims, cached)
        offset_region_index(attn, attn.results[0].type.rank - 2, cached)

        axis = k.type.rank - 2
        shared = value_slice(k, v) if not self.cache else None  # an 8-bit cache keeps both: not yet shared
        caches = []
        for value, name in ((k, "k"), (v, "v"))[: 1 if shared else 2]:
            # An argument's sizes are names: a computed size (a rotary half, D//2 + D//2)
            # gets a name of its own, checked against the computation when bound.
            shape = [
                capacity
                if a == axis
                else d
                if d.is_symbol or d.is_const
                else Dim.sym(fresh_dim(func, f"{name}_cache_{a}"))
                for a, d in enumerate(value.type.shape)
            ]
            stored = TensorType.of(shape, self.cache or value.type.dtype)
            cache = [func.body.add_arg(stored, f"{name}_cache")]
            if self.cache:  # one float32 scale per (token, head) row
                cache.append(func.body.add_arg(TensorType.of(shape[:-1], "f32"), f"{name}_scale"))
            caches.append(cache)
        builder = Builder(func.body, func.body.ops.index(attn))
        kc = builder.emit("ac.cache_append", *caches[0], k, axis=axis, length=cached)
        if shared is not None:  # the values are the cached keys' first features: one cache holds both
            vc = builder.emit("ac.slice", kc, **shared.attrs)
        else:
            vc = builder.emit("ac.cache_append", *caches[1], v, axis=axis, length=cached)
        attn.operands[1], attn.operands[2] = kc, vc
        ret = func.return_op
        new_entries = [k] if shared is not None else [k, v]
        ret.operands = list(ret.operands) + new_entries
        func.attrs.update({"cached_length": cached, "cache_results": len(new_entries)})
        if self.cache:
            func.attrs["cache_type"] = self.cache
        remove_dead_ops(func.body)
