"""What a compiled function becomes when it runs chunk by chunk: its parts and their roles.

The spec is cut by the ``chunk-pairs`` pass (see
:mod:`attncomp.passes.chunk_pairs`) into the attention of one chunk pair,
what computes q, k and v from the arguments (when the spec computes them),
and what it does with the attention's result.  The plan builds each part
once per compiled function and records which of the spec's sizes are split
into chunks: the batch axes the attention can split, the query axis and the
key axis.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from attncomp.chunked.tasks import PartRef, register
from attncomp.compilation import Compilation
from attncomp.ir.core import Op, Value
from attncomp.ir.ops.attention import normalized
from attncomp.ir.parser import parse_ir
from attncomp.passes.base import Pass
from attncomp.passes.chunk_pairs import fused_attention, split_axes
from attncomp.passes.patterns import constant_value
from attncomp.passes.pipeline import edit_pipeline, make_pass, pass_names, pipeline_text


def part_pipeline(
    passes: list[Pass],
    part: str,
    masked: bool = True,
    blocks: tuple[int, int] | None = None,
    offsets: bool = True,
    ragged: bool = False,
    paged: bool = False,
    cache: str = "",
) -> list[Pass]:
    """``passes`` with ``chunk-pairs{part=...}`` run on the fused graph (its options as named).

    ``blocks`` sets flash-tiling's (query, key) blocks: the classifier tiles one tile per chunk
    pair (with ``offsets`` false); a paged decoder's ragged parts take small query blocks.
    ``cache``: a paged part's pools hold 8-bit codes of this type, with their scales.
    """
    cut = make_pass("chunk-pairs", part=part, masked=masked, offsets=offsets, ragged=ragged, paged=paged, cache=cache)
    passes = edit_pipeline(passes, insert=cut, before="flash-tiling")
    if blocks is not None:
        # the function's own tiling options (precision, determinism, batch invariance) with these blocks
        tiling = next((p for p in passes if p.name == "flash-tiling"), None)
        options = {f.name: getattr(tiling, f.name) for f in fields(tiling)} if tiling is not None else {}
        options.update(block_q=blocks[0], block_k=blocks[1])
        passes = edit_pipeline(passes, replace=make_pass("flash-tiling", **options))
    return passes


def _uncast(value: Value) -> Value:
    """What ``value`` is a cast of (itself when it is no cast)."""
    owner = value.owner
    return owner.operands[0] if isinstance(owner, Op) and owner.name == "ac.cast" else value


@dataclass
class Part:
    """One compiled part and the reference a task builds it from."""

    ref: PartRef
    fn: Compilation

    @property
    def arg_names(self) -> list[str]:
        return [a.name for a in self.fn.func.args]

    def offsets(self) -> dict[str, str]:
        """The sequence axes this part's positions start at, and the size naming each start."""
        named = self.fn.func.attrs.get("position_offsets", [])
        return dict(item.split("=") for item in named)


@dataclass
class ChunkPlan:
    fn: Compilation
    #: the attention's batch axes: the spec's size name of each split one, None for the others
    batch: list[str | None] = field(default_factory=list)
    #: per batch axis: whether the keys (and values) follow the query chunk along it
    keys_follow: list[bool] = field(default_factory=list)
    seq_q: str | None = None
    seq_k: str | None = None
    #: the size naming the attention's first batch axis (a paged decoder's sequences bring 1)
    batch_size: str | None = None
    #: the spec's argument feeding q, k, v directly (None: a part computes it)
    direct: dict[str, str | None] = field(default_factory=dict)
    masked_by_spec: bool = True
    attention: Part | None = None
    unmasked: Part | None = None
    #: part name -> the part computing some of q, k, v, and which of them it returns
    inputs: list[tuple[Part, list[str]]] = field(default_factory=list)
    outputs: Part | None = None
    #: when the spec returns the attention's results as they are: "out" / "lse" / "max" per result
    passthrough: list[str] | None = None
    #: the attention's result each of the spec's results is, as it is or cast to the spec's type
    #: ("out" / "lse" / "max"); None when the spec computes something else from them
    returns: list[str] | None = None
    #: whether the attention also gives each row's max score (a chunk pair's third result)
    with_max: bool = False
    #: False: sigmoid attention's unnormalised partial results, which add up (``lse_merge``)
    normalized: bool = True
    #: (block_q, block_k) -> the attention part tiled one tile per chunk pair, in the interpreter
    classifiers: dict[tuple[int, int], Compilation] = field(default_factory=dict)
    _ragged: dict[str, Part] = field(default_factory=dict)

    @property
    def passes(self) -> list[Pass]:
        """The function's passes, with softmax-fusion first where its pipeline has none (as a
        decoder's): the parts are cut at the fused attention."""
        passes = self.fn.passes
        if "softmax-fusion" in pass_names(passes):
            return passes
        return edit_pipeline(passes, insert=make_pass("softmax-fusion"), after="softmax-fusion")

    @property
    def chunkable(self) -> set[str]:
        return {s for s in (*self.batch, self.seq_q, self.seq_k) if s is not None}

    @classmethod
    def of(cls, fn: Compilation) -> ChunkPlan:
        """The plan of ``fn`` (built once per compilation)."""
        return fn.variant("chunk-plan", lambda: cls.build(fn))

    @classmethod
    def build(cls, fn: Compilation) -> ChunkPlan:
        plan = cls(fn)
        fusing = edit_pipeline(plan.passes, until="softmax-fusion")
        fused = fn.derive(fusing, backend="interp").func
        attn = fused_attention(fused)
        q, k, v = attn.operands
        split = split_axes(attn)
        rank = q.type.rank
        plan.batch = [q.type.shape[a].symbol if split[a] else None for a in range(rank - 2)]
        plan.keys_follow = [split[a] and k.type.shape[a] == q.type.shape[a] for a in range(rank - 2)]
        seq_q, seq_k = q.type.shape[-2], k.type.shape[-2]
        plan.seq_q = seq_q.symbol if seq_q.is_symbol else None
        plan.seq_k = seq_k.symbol if seq_k.is_symbol else None
        first = q.type.shape[0] if rank > 2 else None
        plan.batch_size = first.symbol if first is not None and first.is_symbol else None
        args = {a: a.name for a in fused.args}
        plan.direct = {"q": args.get(q), "k": args.get(k), "v": args.get(v)}
        mask_yield = attn.regions[1].ops[-1].operands[0]
        plan.masked_by_spec = constant_value(mask_yield) is not True
        plan.normalized = normalized(attn)

        text = str(fn.input)
        plan.attention = plan._part(text, "attention")
        if plan.masked_by_spec:
            plan.unmasked = plan._part(text, "attention", masked=False)
        computed = [name for name in ("q", "k", "v") if plan.direct[name] is None]
        if computed:
            if seq_q == seq_k:
                plan.inputs = [(plan._part(text, "inputs"), ["q", "k", "v"])]
            else:
                if "q" in computed:
                    plan.inputs.append((plan._part(text, "queries"), ["q"]))
                if "k" in computed or "v" in computed:
                    plan.inputs.append((plan._part(text, "keys"), ["k", "v"]))
        outputs = plan._part(text, "outputs")
        func = outputs.fn.func
        plan.with_max = len(plan.attention.fn.func.results) == 3
        roles = dict(zip(func.args, ("out", "lse", "max")[: 2 + plan.with_max]))
        if all(r in roles for r in func.return_op.operands):
            plan.passthrough = [roles[r] for r in func.return_op.operands]
        else:
            plan.outputs = outputs
        cast = [_uncast(r) for r in func.return_op.operands]
        if all(r in roles for r in cast):
            plan.returns = [roles[r] for r in cast]
        return plan

    def parts(self) -> dict[str, Compilation]:
        """Each compiled part by name: "inputs" (or "queries", "keys"), "attention", "attention_unmasked", "outputs"."""
        named = {ref_part.ref.name.removeprefix(f"{self.fn.name}_"): ref_part.fn for ref_part, _ in self.inputs}
        named["attention"] = self.attention.fn
        if self.unmasked is not None:
            named["attention_unmasked"] = self.unmasked.fn
        if self.outputs is not None:
            named["outputs"] = self.outputs.fn
        return named

    def ragged_attention(self, paged: bool = False, cache: str = "") -> Part:
        """The attention part over a ragged batch of sequences (built once); ``paged``: its keys and
        values read from pools of pages through page tables (``cache``: pools of 8-bit codes of this
        type, with their scales)."""
        key = f"paged{cache}" if paged else "ragged"
        if key not in self._ragged:
            self._ragged[key] = self._part(str(self.fn.input), "attention", ragged=True, paged=paged, cache=cache)
        return self._ragged[key]

    def _part(
        self, text: str, part: str, masked: bool = True, ragged: bool = False, paged: bool = False, cache: str = ""
    ) -> Part:
        fn = self.fn
        # a step's sequences bring a few new tokens each: query blocks of 16 rows; key blocks as the
        # function's own tiling takes them (the CPU's 128: half the per-tile work of 64)
        block_k = next((p.block_k for p in self.passes if p.name == "flash-tiling"), 64)
        blocks = (16, block_k) if ragged else None
        passes = part_pipeline(self.passes, part, masked, blocks, ragged=ragged, paged=paged, cache=cache)
        suffix = ("" if masked else "_unmasked") + ("_ragged" if ragged else "") + ("_paged" if paged else "")
        suffix += f"_{cache}" if cache else ""
        ref = PartRef(text, fn.backend, pipeline_text(passes), f"{fn.name}_{part}{suffix}")
        compiled = fn.derive(passes, name=ref.name, module=parse_ir(text))
        register(ref, compiled)
        return Part(ref, compiled)

    def classifier(self, blocks: tuple[int, int]) -> Compilation:
        """The attention part tiled with one tile per chunk pair, in the interpreter: it classifies pairs."""
        passes = part_pipeline(self.passes, "attention", True, blocks, offsets=False)
        return self.fn.derive(passes, backend="interp", name=f"{self.fn.name}_chunk_pairs")
