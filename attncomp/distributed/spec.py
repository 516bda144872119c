"""What context parallelism needs of a compiled function: its chunk-pair parts and their roles.

The parts are the Dask path's (:class:`attncomp.chunked.plan.ChunkPlan`): the attention
of one (query chunk, key chunk) pair at absolute positions, and the same without its
mask for pairs proven fully visible; each with its compiled backward, which recomputes
the pair's probabilities from the saved (whole-row) LSE.  An argument is *per position*
when one of its axes is the sequence's (document ids ``doc[b, t]``): a rank passes its
shard of it, and the call gathers the whole.  Other captured arguments (ALiBi slopes, a
bias table) are whole on every rank, and their gradients are summed across ranks.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from attncomp.blockmap import block_map
from attncomp.chunked.plan import ChunkPlan
from attncomp.compilation import Compilation
from attncomp.gradients import backward_of
from attncomp.ir.binding import bind_arguments
from attncomp.ir.types import NUMPY_DTYPES, is_float

#: torch dtype names -> the spec's float types (a generic spec picks its member by q's)
FLOAT_TYPES = {"float16": "f16", "bfloat16": "bf16", "float32": "f32", "float64": "f64"}


class NotContextParallel(ValueError):
    """The spec cannot run with its sequence sharded across ranks; the message says why."""


@dataclass
class Argument:
    name: str
    dtype: str
    #: the axis along the sequence, or None (a whole argument on every rank)
    seq_axis: int | None
    floating: bool


@dataclass
class PairPart:
    """One chunk-pair part (masked or not), its backward and the captured arguments each reads."""

    forward: Compilation
    backward: Compilation
    reads: list[str]
    #: the backward's results: one per floating argument of the part, by name
    grads: list[str]


@dataclass
class SpecParts:
    member: Compilation
    plan: ChunkPlan
    arguments: list[Argument]
    q: str
    k: str
    v: str
    #: the attention's results the spec returns, in order: "out", "lse" and "max" (each row's max
    #: score), each in the spec's result type
    returns: list[str]
    masked: PairPart
    unmasked: PairPart
    #: per index axis of the attention: the size naming its offset ("" if never split)
    offsets: list[str]
    digest: str
    _classifiers: dict[int, Compilation] = field(default_factory=dict)

    @classmethod
    def of(cls, fn: Any, dtype: str | None) -> SpecParts:
        member = fn.for_dtype(dtype) if getattr(fn, "generic", False) else fn
        compilation: Compilation = member.compilation
        return compilation.variant("context-parallel", lambda: cls.build(compilation))

    @classmethod
    def build(cls, compilation: Compilation) -> SpecParts:
        plan = ChunkPlan.of(compilation)  # refuses specs that mix positions, naming the op
        name = compilation.name
        computed = [role for role in ("q", "k", "v") if plan.direct[role] is None]
        if computed:
            raise NotContextParallel(
                f"@{name}: context parallelism takes q, k and v as arguments, but the spec computes "
                f"{', '.join(computed)}; compute projections in torch around the call"
            )
        if plan.returns is None:
            raise NotContextParallel(
                f"@{name}: context parallelism takes a spec that returns the attention's output (and LSE, each "
                "row's max score) as they are; apply what follows (merging heads, projections) in torch"
            )
        if plan.seq_q is None or plan.seq_k is None:
            raise NotContextParallel(f"@{name}: the query and key sequence lengths must be sizes, not constants")
        q, k, v = (plan.direct[role] for role in ("q", "k", "v"))
        arguments = []
        for arg in compilation.func.args:
            shape = arg.type.shape
            seq = [a for a, d in enumerate(shape) if d.is_symbol and d.symbol in (plan.seq_q, plan.seq_k) and d.symbol]
            if len(seq) > 1:
                raise NotContextParallel(f"{arg.name}: has {len(seq)} sequence axes; a per-position argument has one")
            axis = seq[0] - len(shape) if seq else None
            arguments.append(Argument(arg.name, arg.type.dtype, axis, is_float(arg.type.dtype)))
        for role in (q, k, v):
            if next(a for a in arguments if a.name == role).seq_axis != -2:
                raise NotContextParallel(f"{role}: the sequence must be its second last axis")
        masked = _pair_part(plan.attention.fn)
        unmasked = _pair_part(plan.unmasked.fn) if plan.unmasked is not None else masked
        digest = hashlib.sha256(f"{compilation.backend}\n{compilation.pipeline}\n{compilation.input}".encode())
        return cls(
            compilation,
            plan,
            arguments,
            q,
            k,
            v,
            list(plan.returns),
            masked,
            unmasked,
            list(plan.attention.fn.func.attrs["chunk_offsets"]),
            digest.hexdigest()[:16],
        )

    def argument(self, name: str) -> Argument:
        return next(a for a in self.arguments if a.name == name)

    @property
    def per_position(self) -> list[str]:
        return [a.name for a in self.arguments if a.seq_axis is not None and a.name not in (self.q, self.k, self.v)]

    def sizes(self, whole: dict[str, Any]) -> dict[str, int]:
        """The spec's sizes for the whole sequence: ``whole`` maps each argument to an array of its
        whole shape (stand-ins for q, k and v; the values of captured ones)."""
        args = [whole[a.name] for a in self.arguments]
        _, env = bind_arguments(self.member.func, args, self.member.constraints)
        return dict(env)

    def pair_classes(self, whole: dict[str, Any], chunk: int) -> np.ndarray:
        """int8 ``[chunks, chunks]``: per (query chunk, key chunk), 0 fully masked, 1 partly
        visible, 2 fully visible, for every batch entry and head (the classification of
        tiles, run with one tile per chunk pair on the whole sequence's captured values)."""
        tiles = self.tiles(whole, chunk)
        visible = (tiles != 0).reshape(-1, *tiles.shape[-2:]).any(axis=0)
        full = (tiles == 2).reshape(-1, *tiles.shape[-2:]).all(axis=0)
        return np.where(full, 2, np.where(visible, 1, 0)).astype(np.int8)

    def tiles(self, whole: dict[str, Any], block: int) -> np.ndarray:
        """The block map ``[*batch, q_blocks, k_blocks]`` with square tiles of ``block`` positions."""
        classifier = self._classifiers.get(block)
        if classifier is None:
            classifier = self._classifiers[block] = self.plan.classifier((block, block))
        func = classifier.func
        roles = {"q_chunk": self.q, "k_chunk": self.k, "v_chunk": self.v}
        args = [whole[roles.get(a.name, a.name)] for a in func.args]
        sizes = dict(self.sizes(whole), **{n: 0 for n in self.offsets if n})
        return block_map(func, classifier.constraints, tuple(args), sizes)


def _pair_part(forward: Compilation) -> PairPart:
    backward = backward_of(forward)
    names = [a.name for a in forward.func.args]
    floating = [a.name for a in forward.func.args if is_float(a.type.dtype)]
    return PairPart(forward, backward, names[3:], floating)


def standin(shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """An array of ``shape`` and the spec's ``dtype`` that holds no memory (shapes are bound on it)."""
    return np.broadcast_to(np.zeros((), dtype=NUMPY_DTYPES[dtype]), shape)
