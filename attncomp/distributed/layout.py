"""Which rank holds which chunks of the sequence: a layout balanced by the mask's live tiles.

The sequence of ``length`` positions is cut into ``world * chunks_per_rank`` chunks of
equal size; each rank holds ``chunks_per_rank`` of them, in ascending order, as one
shard.  Under context parallelism a rank computes its own queries against every key,
so its work is the live tiles in its chunks' query rows: :func:`balance` counts them
from the block map (the same classification mask-elimination makes, run on the
whole sequence's captured tensors) and deals the chunks out heaviest first to the
least loaded rank with room.  Causal masks come out as the zigzag (chunk ``c`` with
chunk ``2W - 1 - c``); windows keep the contiguous split, whose neighbours need only
their neighbours' keys; packed documents get their own deal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

#: chunks per rank that :func:`balance` tries, fewest first
CHUNKS_PER_RANK = (1, 2, 4, 8)
#: the live-tile imbalance (max over ranks / mean) under which fewer chunks per rank win
GOOD_ENOUGH = 1.05
#: the imbalance the contiguous split may keep when its keys travel fewer ring steps
LOCAL_ENOUGH = 1.25


@dataclass(frozen=True)
class Layout:
    """``owner[c]``: the rank holding chunk ``c`` (positions ``c * chunk`` to ``(c + 1) * chunk``).

    ``work[c]``: the live tiles of ``block x block`` in chunk ``c``'s query rows, summed over
    batch and heads (the measure the deal balanced; all ones for a layout made by hand).
    """

    world: int
    length: int
    chunk: int
    owner: tuple[int, ...]
    work: tuple[float, ...]
    block: int = 0

    def __post_init__(self) -> None:
        if self.world <= 0 or self.chunk <= 0:
            raise ValueError(f"Layout: world and chunk must be positive, got {self.world} and {self.chunk}")
        if self.chunk * len(self.owner) != self.length:
            raise ValueError(f"Layout: {len(self.owner)} chunks of {self.chunk} do not make length {self.length}")
        counts = np.bincount(np.asarray(self.owner, dtype=np.int64), minlength=self.world)
        if len(counts) != self.world or len(set(counts.tolist())) != 1:
            raise ValueError(f"Layout: every rank must hold the same number of chunks, got {counts.tolist()}")

    @classmethod
    def contiguous(cls, world: int, length: int, chunks_per_rank: int = 1) -> Layout:
        """Rank ``r`` holds positions ``r * length / world`` onwards, in one piece."""
        n = world * chunks_per_rank
        if world <= 0 or length % n:
            raise ValueError(f"Layout: length {length} is not a multiple of {n} chunks ({world} ranks)")
        owner = tuple(c // chunks_per_rank for c in range(n))
        return cls(world, length, length // n, owner, (1.0,) * n)

    @property
    def chunks_per_rank(self) -> int:
        return len(self.owner) // self.world

    @property
    def shard_length(self) -> int:
        return self.chunk * self.chunks_per_rank

    def chunks(self, rank: int) -> tuple[int, ...]:
        """The chunks ``rank`` holds, in the order of its shard."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank: {rank} is not in 0..{self.world - 1}")
        return tuple(c for c, r in enumerate(self.owner) if r == rank)

    def positions(self, rank: int) -> np.ndarray:
        """The absolute positions of ``rank``'s shard, in order."""
        return np.concatenate([np.arange(c * self.chunk, (c + 1) * self.chunk) for c in self.chunks(rank)])

    def rank_work(self) -> np.ndarray:
        work = np.asarray(self.work, dtype=np.float64)
        return np.bincount(np.asarray(self.owner), weights=work, minlength=self.world)

    @property
    def imbalance(self) -> float:
        """Max over ranks of their live tiles, over the mean (1.0: perfectly balanced)."""
        work = self.rank_work()
        return float(work.max() / work.mean()) if work.mean() > 0 else 1.0

    def shard(self, x: Any, rank: int, dim: int = -2) -> Any:
        """``rank``'s shard of ``x`` (a whole-sequence numpy array or torch tensor) along ``dim``."""
        _check_length(x, dim, self.length, "x")
        return _cat(x, [_narrow(x, dim, c * self.chunk, self.chunk) for c in self.chunks(rank)], dim)

    def unshard(self, shards: list[Any], dim: int = -2) -> Any:
        """The whole sequence from every rank's shard (in rank order) along ``dim``."""
        if len(shards) != self.world:
            raise ValueError(f"shards: expected one per rank ({self.world}), got {len(shards)}")
        for rank, s in enumerate(shards):
            _check_length(s, dim, self.shard_length, f"shards[{rank}]")
        place = {c: (r, k) for r in range(self.world) for k, c in enumerate(self.chunks(r))}
        pieces = []
        for c in range(len(self.owner)):
            rank, k = place[c]
            pieces.append(_narrow(shards[rank], dim, k * self.chunk, self.chunk))
        return _cat(shards[0], pieces, dim)

    def describe(self) -> str:
        chunks = " | ".join(" ".join(str(c) for c in self.chunks(r)) for r in range(self.world))
        return (
            f"{self.world} ranks x {self.chunks_per_rank} chunks of {self.chunk} positions: {chunks}; "
            f"live-tile imbalance {self.imbalance:.3f}"
        )


def _check_length(x: Any, dim: int, want: int, name: str) -> None:
    got = x.shape[dim]
    if got != want:
        raise ValueError(f"{name}: expected {want} positions along dimension {dim}, got {got}")


def _narrow(x: Any, dim: int, start: int, size: int) -> Any:
    if hasattr(x, "narrow"):
        return x.narrow(dim, start, size)
    index = [slice(None)] * x.ndim
    index[dim] = slice(start, start + size)
    return x[tuple(index)]


def _cat(like: Any, pieces: list[Any], dim: int) -> Any:
    if hasattr(like, "narrow"):
        import torch

        return torch.cat(pieces, dim)
    return np.concatenate(pieces, axis=dim)


def deal(work: np.ndarray, world: int) -> tuple[int, ...]:
    """Chunks to ranks, heaviest chunk first to the least loaded rank that has room.

    Every rank gets ``len(work) / world`` chunks; ties go to the lower rank, so the deal is
    the same on every rank.
    """
    n = len(work)
    room = n // world
    owner = [0] * n
    load = np.zeros(world)
    held = np.zeros(world, dtype=np.int64)
    for c in sorted(range(n), key=lambda c: (-work[c], c)):
        open_ranks = [r for r in range(world) if held[r] < room]
        rank = min(open_ranks, key=lambda r: (load[r], r))
        owner[c] = rank
        load[rank] += work[c]
        held[rank] += 1
    return tuple(owner)


def live_tiles(tiles: np.ndarray) -> np.ndarray:
    """``[q_blocks, k_blocks]``: the live tiles of a block map, counted over every batch axis."""
    live = tiles != 0
    return live.reshape(-1, *live.shape[-2:]).sum(axis=0)


def ring_steps(layout: Layout, live: np.ndarray) -> int:
    """How far keys travel around the ring for ``layout``: the largest ``(r - s) % world`` over
    ranks ``r`` whose queries see a key of rank ``s`` (0: every rank needs only its own keys)."""
    n = len(layout.owner)
    pairs = live.reshape(n, live.shape[0] // n, n, -1).any(axis=(1, 3))
    owner = np.asarray(layout.owner)
    q_rank, k_rank = np.nonzero(pairs)
    return int(((owner[q_rank] - owner[k_rank]) % layout.world).max(initial=0))


def choose(live: np.ndarray, block: int, world: int, length: int, chunks_per_rank: int | None) -> Layout:
    """The layout for the live tiles ``live`` (``[q_blocks, k_blocks]`` of ``block`` positions).

    The contiguous split when it is balanced within 5%, or within 25% while its keys travel
    fewer steps around the ring than the deal's (a window's ranks need only their neighbours'
    keys); else the fewest chunks per rank whose deal is balanced within 5%; else the best deal.
    """
    rows = live.sum(axis=1).astype(np.float64)
    candidates = [chunks_per_rank] if chunks_per_rank is not None else list(CHUNKS_PER_RANK)
    contiguous: Layout | None = None
    layouts = []
    for c in candidates:
        n = world * c
        if length % n or (length // n) % block:
            continue
        work = tuple(rows.reshape(n, -1).sum(axis=1))
        chunk = length // n
        if contiguous is None:
            contiguous = Layout(world, length, chunk, tuple(k // c for k in range(n)), work, block)
            if contiguous.imbalance <= GOOD_ENOUGH:
                return contiguous
        layout = Layout(world, length, chunk, deal(np.asarray(work), world), work, block) if c > 1 else contiguous
        layouts.append(layout)
        if layout.imbalance <= GOOD_ENOUGH:
            break
    if contiguous is None:
        raise ValueError(
            f"length {length} cannot be cut into {world} ranks x {candidates} chunks of whole tiles of {block}"
        )
    best = min(layouts, key=lambda layout: layout.imbalance)
    if contiguous.imbalance <= LOCAL_ENOUGH and ring_steps(contiguous, live) < ring_steps(best, live):
        return contiguous
    return best
