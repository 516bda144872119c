"""chunk-pairs: the parts of a fused spec that a chunked (Dask) run schedules.

A chunked run splits the sequence axes into chunks and runs the attention
once per (query chunk, key chunk) pair, merging the partial results by their
log-sum-exp.  After softmax-fusion this pass cuts the function at its one
fused ``ac.attention`` into the part named by ``part``:

``attention``
    The attention of one chunk pair.  Its first three arguments are the
    chunks of q, k and v (``q_chunk``, ``k_chunk``, ``v_chunk``), with sizes
    of their own (``q_rows``, ``k_rows``, ``B_chunk``...); then come the
    captured inputs the score and mask functions read, whole.  The regions
    see absolute positions: each index argument plus an offset bound by the
    caller (``q_start``, ``k_start``, ``B_start``...), so masks, ALiBi and
    gathers from captured tensors stay right.  The spec's own sizes (``T``,
    ``S``, ``B``...) keep meaning the whole sequence and batch.  It returns
    the partial output and its log-sum-exp, then, where the attention also
    gives each row's max score (``with_max``), the chunk's max: partials
    merge by their log-sum-exp and the larger max.  With ``masked = false`` the
    mask is dropped: for chunk pairs proven fully visible.
``inputs`` / ``queries`` / ``keys``
    What computes q, k and v (projections, rotary embeddings, norms) from the
    spec's arguments, over one chunk of positions: all three when queries
    and keys run along the same axis, else q alone or k and v.  Positions
    (``ac.iota``) along a sequence axis are offset by ``<axis>_start``.
``outputs``
    What the spec does with the attention's output and log-sum-exp (merging
    heads, an output projection), over one chunk of query positions: its
    first arguments ``attention_out``, ``attention_lse`` (and
    ``attention_max`` with a row max).

Every op outside the attention must be position-wise along the chunked axes;
an op that mixes positions (a reduction over the sequence) is refused,
naming it, as kv-cache-reuse refuses.  The function attribute
``chunk_offsets`` lists, per index axis of the attention (batch axes, then
queries and keys), the name of its offset, or "" for an axis that is never
split (a head axis shared through ``kv_repeat``); ``position_offsets`` lists
the other parts' offsets as "axis=offset".

With ``paged = true`` the attention reads its keys and values from pools of
pages through a page table (``ac.page_view``); with ``cache = f8e4m3`` (or
``f8e5m2``) as well, the pools hold 8-bit codes and beside each a float32
argument ``k_scales`` (``v_scales``), one scale per (token, head) row in the
pages' own layout, and the views are every row dequantised (``ir.quantized``);
the function carries ``cache_type``.
"""

from __future__ import annotations

from dataclasses import dataclass

from attncomp.errors import PipelineError
from attncomp.ir.core import Func, Module, Op, Value
from attncomp.ir.dims import Dim, dim
from attncomp.ir.graph import remove_dead_ops
from attncomp.ir.ops import Checker
from attncomp.ir.ops.attention import add_lse, attention_types, with_max
from attncomp.ir.printer import Namer
from attncomp.ir.types import CACHE_DTYPES, TensorType
from attncomp.passes.base import Pass, register_pass
from attncomp.passes.builder import Builder
from attncomp.passes.kv_cache_reuse import find_mixing, fresh_dim, offset_iotas, offset_region_index
from attncomp.passes.rewrite import replace_uses

PARTS = ("attention", "inputs", "queries", "keys", "outputs")


class NotChunkable(PipelineError):
    """The spec cannot run chunk by chunk; the message names the op."""


def fused_attention(func: Func) -> Op:
    attns = [op for op in func.body.ops if op.name == "ac.attention"]
    if len(attns) != 1:
        raise NotChunkable(
            f"chunk-pairs: needs exactly one fused attention (run softmax-fusion first), found {len(attns)}"
        )
    return attns[0]


def split_axes(attn: Op) -> list[bool]:
    """Per batch axis of the attention, whether chunks may split it.

    An axis may be split when q names it and k and v either name it too or
    broadcast over it; a head axis shared through ``kv_repeat`` stays whole.
    """
    q, k, v = (x.type for x in attn.operands)
    rank = q.rank
    repeat = attn.attrs["kv_repeat"]
    split = []
    for a in range(rank - 2):
        d = q.shape[a]
        ok = d.is_symbol and all(t.shape[a] in (d, dim(1)) for t in (k, v))
        split.append(ok and not (a == 1 and dim(repeat) != dim(1)))
    return split


def _mixing_op(func: Func, roots: list[Value], axes: list[Dim], part: str) -> None:
    """Refuse, naming the op, when something on the paths to ``roots`` mixes positions along ``axes``."""
    found = find_mixing(func, roots, axes)
    if found is not None:
        name, op, axis, why = found
        why = why.replace("the key axis", f"the axis {axis}")
        raise NotChunkable(
            f"chunk-pairs: %{name} = {op.name} is outside the attention ({part}) and {why}, "
            "so it cannot run chunk by chunk"
        )


def _reads_chunked_size(func: Func, axes: list[Dim], part: str) -> None:
    """Refuse a size of a split axis read as a value: a chunk's own size is not the sequence's."""
    names = {d.symbol for d in axes if d.is_symbol}
    namer = Namer.for_func(func)
    for op in func.body.walk():
        if op.name == "ac.dim" and op.attrs["value"].symbols() & names:
            raise NotChunkable(
                f"chunk-pairs: %{namer[op.results[0]]} = ac.dim {{value = {op.attrs['value']}}} is outside the "
                f"attention ({part}) and reads the size of an axis that chunks split, so it cannot run chunk by chunk"
            )


def _prune_args(func: Func, first: list[Value]) -> None:
    """Drop arguments nothing reads; ``first`` lead, the others keep their order."""
    used: set[Value] = set()
    for op in func.body.walk():
        used.update(op.operands)
    rest = [a for a in func.body.args if a in used and a not in first]
    func.body.args = [*first, *rest]


def _offset_positions(func: Func, axes: list[Dim]) -> None:
    """Positions along each sequence axis start at an offset; ``position_offsets`` lists "axis=offset"."""
    named = []
    for axis in axes:
        if axis.is_symbol:
            offset = fresh_dim(func, f"{axis.symbol}_start")
            offset_iotas(func, {axis}, Dim.sym(offset))
            named.append(f"{axis.symbol}={offset}")
    func.attrs["position_offsets"] = named


def _ragged(func: Func, attn: Op, rank: int, batch: Dim, q_rows: str) -> list[Value]:
    """Each batch entry its own sequence: query positions, key start and key count per entry."""
    positions = func.body.add_arg(TensorType((batch, Dim.sym(q_rows)), "i64"), "q_positions")
    starts = func.body.add_arg(TensorType((batch,), "i64"), "k_starts")
    lengths = func.body.add_arg(TensorType((batch,), "i64"), "k_lengths")
    for region in attn.regions:
        b, i, j = region.args[0], region.args[rank - 2], region.args[rank - 1]
        builder = Builder(region, 0)
        row = builder.emit("ac.gather", positions, b, i)
        key = builder.emit("ac.add", j, builder.emit("ac.gather", starts, b))
        replace_uses(region, {i: row, j: key})
        row.owner.operands[1:] = [b, i]
        key.owner.operands[0] = j
    mask = attn.regions[1]
    done = mask.ops[-1]
    builder = Builder(mask, len(mask.ops) - 1)
    inside = builder.emit("ac.cmp", mask.args[rank - 1], builder.emit("ac.gather", lengths, mask.args[0]), pred="lt")
    done.operands[0] = builder.emit("ac.and", done.operands[0], inside)
    return [positions, starts, lengths]


@register_pass
@dataclass
class ChunkPairs(Pass):
    name = "chunk-pairs"
    summary = "cut the function at its fused attention into the parts a chunked run schedules"
    part: str = "attention"
    masked: bool = True
    offsets: bool = True
    ragged: bool = False
    paged: bool = False
    #: the pools' element type: "" (the keys' and values' own) or an 8-bit type with scales (``paged``)
    cache: str = ""

    def run(self, module: Module, remarks: list[str]) -> None:
        if self.part not in PARTS:
            raise PipelineError(f"chunk-pairs: part must be one of {', '.join(PARTS)}, not {self.part!r}")
        if self.cache and self.cache not in CACHE_DTYPES:
            raise PipelineError(
                f"chunk-pairs: cache must be one of {', '.join(CACHE_DTYPES)} (or absent), got {self.cache!r}"
            )
        if self.cache and not (self.paged and self.part == "attention"):
            raise PipelineError(
                "chunk-pairs: cache= is the element type of a paged attention's pools (part=attention, paged=true)"
            )
        func = module.main
        attn = fused_attention(func)
        q = attn.operands[0]
        rank = q.type.rank
        split = split_axes(attn)
        offsets = [fresh_dim(func, f"{q.type.shape[a].symbol}_start") if split[a] else "" for a in range(rank - 2)]
        offsets += [fresh_dim(func, "q_start"), fresh_dim(func, "k_start")]
        if self.part == "attention":
            self._attention(func, attn, split, offsets)
            func.attrs["chunk_offsets"] = offsets
        elif self.part == "outputs":
            self._outputs(func, attn, split)
        else:
            self._inputs(func, attn, split)

    def _attention(self, func: Func, attn: Op, split: list[bool], offsets: list[str]) -> None:
        q, k, v = attn.operands
        rank = q.type.rank
        fresh: dict[Dim, Dim] = {}

        def chunk_dim(d: Dim, a: int, rows: str) -> Dim:
            if a == rank - 2:
                return Dim.sym(rows)
            if a < rank - 2 and split[a] and d.is_symbol:
                key = d
                base = f"{d.symbol}_chunk"
            elif d.is_symbol or d.is_const:
                return d
            else:  # a computed size (a projection's head dimension) gets a name of its own
                key, base = d, f"size{len(fresh)}"
            if key not in fresh:
                fresh[key] = Dim.sym(fresh_dim(func, base))
            return fresh[key]

        q_rows, k_rows = fresh_dim(func, "q_rows"), fresh_dim(func, "k_rows")
        chunks = []
        for value, rows, name in ((q, q_rows, "q_chunk"), (k, k_rows, "k_chunk"), (v, k_rows, "v_chunk")):
            shape = [chunk_dim(d, a, rows) for a, d in enumerate(value.type.shape)]
            chunks.append(func.body.add_arg(value.type.with_shape(shape), name))
        first = list(chunks)
        batch = chunks[0].type.shape[0]  # a ragged chunk: one sequence per entry of the first axis
        if self.ragged and rank < 3:
            raise NotChunkable("chunk-pairs: ragged chunks need a batch axis: one sequence per batch entry")
        if self.paged:  # keys and values read through a page table from a pool of pages
            del func.body.args[-2:]
            pool = Dim.sym(fresh_dim(func, "num_pages")), Dim.sym(fresh_dim(func, "page_size"))
            pages, scales = [], []
            for c, n in ((chunks[1], "k"), (chunks[2], "v")):  # [num_pages, *heads, page_size, d]
                shape = (pool[0], *c.type.shape[1:-2], pool[1], c.type.shape[-1])
                pages.append(func.body.add_arg(TensorType.of(shape, self.cache or c.type.dtype), f"{n}_pages"))
                if self.cache:  # one float32 scale per (token, head) row, where its row is
                    scales.append(func.body.add_arg(TensorType.of(shape[:-1], "f32"), f"{n}_scales"))
            entries = Dim.sym(fresh_dim(func, "table_entries"))
            table_shape = (batch, entries) if self.ragged else (entries,)
            table = func.body.add_arg(TensorType(table_shape, "i64"), "page_table")
            builder = Builder(func.body, 0)
            views = []
            for k, (p, c) in enumerate(zip(pages, chunks[1:])):
                operands = [p, table, scales[k]] if self.cache else [p, table]
                seen = (table_shape[0] if self.ragged else dim(1), *p.type.shape[1:-2], Dim.sym(k_rows))
                read_as = [TensorType.of((*seen, p.type.shape[-1]), c.type.dtype)]  # the chunk's float type
                views.append(builder.op("ac.page_view", operands, {"rows": Dim.sym(k_rows)}, read_as).result)
            chunks[1:] = views
            first = [chunks[0], *(x for k in range(2) for x in [pages[k], *scales[k : k + 1]]), table]
            if self.cache:
                func.attrs["cache_type"] = self.cache
        attn.operands = list(chunks)
        add_lse(attn)
        types = attention_types(
            *(c.type for c in chunks), dim(attn.attrs["kv_repeat"]), True, Checker(), attn.name, with_max(attn)
        )
        for result, t in zip(attn.results, types):
            result.type = t
        for position, name in enumerate(offsets):
            if name and self.offsets and not (self.ragged and position >= rank - 2):
                offset_region_index(attn, position, Dim.sym(name))
        if self.ragged:
            first += _ragged(func, attn, rank, batch, q_rows)
        if not self.masked:
            mask = attn.regions[1]
            mask.ops = []
            builder = Builder(mask)
            builder.yield_(builder.const(True, "i1"))
        func.return_op.operands = list(attn.results)
        remove_dead_ops(func.body)
        _prune_args(func, first)

    def _inputs(self, func: Func, attn: Op, split: list[bool]) -> None:
        q, k, v = attn.operands
        rank = q.type.rank
        seq_q, seq_k = q.type.shape[-2], k.type.shape[-2]
        batch = [q.type.shape[a] for a in range(rank - 2) if split[a]]
        if self.part == "inputs" and seq_q != seq_k:
            raise NotChunkable(
                f"chunk-pairs: queries ({seq_q}) and keys ({seq_k}) run along different axes: "
                "cut the inputs with part=queries and part=keys"
            )
        if self.part in ("inputs", "queries"):
            _mixing_op(func, [q], [seq_q, *batch], "computing q")
        if self.part in ("inputs", "keys"):
            _mixing_op(func, [k, v], [seq_k, *batch], "computing k and v")
        roots = {"inputs": [q, k, v], "queries": [q], "keys": [k, v]}[self.part]
        func.return_op.operands = list(roots)
        remove_dead_ops(func.body)
        _reads_chunked_size(func, [seq_q, seq_k, *batch], "computing q, k and v")
        _offset_positions(func, [seq_q] if seq_q == seq_k else [seq_q, seq_k])
        _prune_args(func, [])

    def _outputs(self, func: Func, attn: Op, split: list[bool]) -> None:
        q = attn.operands[0]
        rank = q.type.rank
        seq_q = q.type.shape[-2]
        batch = [q.type.shape[a] for a in range(rank - 2) if split[a]]
        add_lse(attn)
        names = ("attention_out", "attention_lse", "attention_max")
        new = [func.body.add_arg(result.type, name) for result, name in zip(attn.results, names)]
        replace_uses(func.body, dict(zip(attn.results, new)))
        remove_dead_ops(func.body)
        _mixing_op(func, list(func.return_op.operands), [seq_q, *batch], "using its result")
        _reads_chunked_size(func, [seq_q, *batch], "using its result")
        _offset_positions(func, [seq_q])
        _prune_args(func, new)
