"""The ring: keys and values travel from rank to rank while each computes its chunk pairs.

At step ``s`` rank ``r`` holds the keys and values of rank ``(r - s) % world``; it posts
their send to ``r + 1`` (and the receive of the next from ``r - 1``) before computing its
pairs with them, so the transfer runs under the computation.  The ring stops after as many
steps as the farthest keys a rank's queries see (the pair classes say): a window whose
layout is contiguous needs one step, a causal mask ``world - 1``.

Forward: each (query chunk, key chunk) pair that the classes leave visible runs the
chunk-pair attention at its absolute positions (without its mask when fully visible),
and the partials of a query chunk merge by their log-sum-exp.  Backward: the same pairs
run the part's backward with the whole row's output and LSE, which recomputes the pair's
probabilities exactly as the single-device backward does; dQ stays home, dK and dV ride
the ring with their keys (sent after each step's pairs, received under the next step's)
and go back to their owner after the last step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from attncomp.distributed.collectives import Comm
from attncomp.distributed.layout import Layout
from attncomp.distributed.pairs import merge, run_part
from attncomp.distributed.spec import PairPart, SpecParts


@dataclass
class Step:
    """What one call computes, the same on every rank."""

    parts: SpecParts
    layout: Layout
    #: ``[chunks, chunks]``: 0 skipped, 1 run with the mask, 2 run without it
    classes: np.ndarray
    #: how many times keys move on around the ring
    steps: int
    #: the spec's sizes for the whole sequence
    sizes: dict[str, int]
    #: captured arguments by name, whole (per-position ones gathered from every rank)
    captured: dict[str, Any]

    def pairs(self, rank: int, source: int) -> list[tuple[int, int, int, int, PairPart]]:
        """(query chunk, its place in ``rank``'s shard, key chunk, its place in ``source``'s, part)
        for every pair the classes leave visible."""
        layout, found = self.layout, []
        for m, qc in enumerate(layout.chunks(rank)):
            for n, kc in enumerate(layout.chunks(source)):
                kind = self.classes[qc, kc]
                if kind:
                    found.append((qc, m, kc, n, self.parts.unmasked if kind == 2 else self.parts.masked))
        return found

    def pair_sizes(self, qc: int, kc: int) -> dict[str, int]:
        names = self.parts.offsets
        chunk = self.layout.chunk
        sizes = dict(self.sizes, **{n: 0 for n in names[:-2] if n})
        sizes[names[-2]], sizes[names[-1]] = qc * chunk, kc * chunk
        return sizes


def _piece(x: Any, place: int, chunk: int) -> Any:
    return x.narrow(-2, place * chunk, chunk)


def forward(torch: Any, comm: Comm, step: Step, q: Any, k: Any, v: Any) -> tuple[list[Any], int]:
    """This rank's output and LSE (float32) for its shard (and each row's max score, where the
    spec takes it), and the pairs it computed."""
    rank, world, chunk = comm.rank, comm.world, step.layout.chunk
    mine = step.layout.chunks(rank)
    partial: dict[int, tuple[Any, ...] | None] = dict.fromkeys(mine)
    kv, computed = [k, v], 0
    for s in range(step.steps + 1):
        source = (rank - s) % world
        if s < step.steps:
            following, works = comm.exchange(kv, (rank + 1) % world, (rank - 1) % world)
        for qc, m, kc, n, part in step.pairs(rank, source):
            reads = [step.captured[name] for name in part.reads]
            pieces = [_piece(q, m, chunk), _piece(kv[0], n, chunk), _piece(kv[1], n, chunk), *reads]
            found = run_part(torch, part.forward, pieces, step.pair_sizes(qc, kc))
            partial[qc] = merge(torch, partial[qc], tuple(found), step.parts.plan.normalized)
            computed += 1
        if s < step.steps:
            comm.wait(works, f"the keys and values of rank {(source - 1) % world}")
            kv = following
    rows: list[list[Any]] = [[] for _ in step.parts.masked.forward.func.results]
    for qc in mine:
        found = partial[qc]
        if found is None:  # no key reaches these rows: zeros, LSE (and max) -inf
            shape = (*q.shape[:-2], chunk, v.shape[-1])
            unreached = torch.full(shape[:-1], float("-inf"), device=q.device)
            found = (torch.zeros(shape, dtype=torch.float32, device=q.device), *([unreached] * (len(rows) - 1)))
        for kept, result in zip(rows, found):
            kept.append(result)
    return [torch.cat(kept, -2 if n == 0 else -1) for n, kept in enumerate(rows)], computed


def backward(
    torch: Any, comm: Comm, step: Step, saved: tuple[Any, ...], d_out: Any, d_lse: Any
) -> tuple[Any, Any, Any, dict[str, Any]]:
    """dQ, dK, dV of this rank's shards (float32) and the float captured arguments' gradients
    from this rank's pairs (whole; the caller sums them over ranks)."""
    q, k, v, out, lse = saved
    rank, world, chunk = comm.rank, comm.world, step.layout.chunk
    d_q = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    d_captured = {
        name: torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for name, x in step.captured.items()
        if step.parts.argument(name).floating
    }
    kv = [k, v]
    d_kv: list[Any] = []
    arrived: list[Any] = []  # the key gradients coming from the left neighbour, and their transfer
    d_works: list[Any] = []
    for s in range(step.steps + 1):
        source = (rank - s) % world
        if s < step.steps:
            following, works = comm.exchange(kv, (rank + 1) % world, (rank - 1) % world)
        d_k = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        d_v = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        for qc, m, kc, n, part in step.pairs(rank, source):
            rows = [_piece(x, m, chunk) for x in (out, d_out)]
            lse_rows = [x.narrow(-1, m * chunk, chunk) for x in (lse, d_lse)]
            reads = [step.captured[name] for name in part.reads]
            pieces = [_piece(q, m, chunk), _piece(kv[0], n, chunk), _piece(kv[1], n, chunk), *reads]
            arguments = [*pieces, rows[0], lse_rows[0], rows[1], lse_rows[1]]
            if step.parts.plan.with_max:  # the max score's cotangent: it passes no gradient
                arguments.append(torch.zeros_like(lse_rows[1]))
            grads = dict(zip(part.grads, run_part(torch, part.backward, arguments, step.pair_sizes(qc, kc))))
            _piece(d_q, m, chunk).add_(grads["q_chunk"])
            _piece(d_k, n, chunk).add_(grads["k_chunk"])
            _piece(d_v, n, chunk).add_(grads["v_chunk"])
            for name in d_captured:
                if name in grads:
                    d_captured[name].add_(grads[name])
        if s > 0:  # the gradients of these keys so far, from the ranks they visited before
            comm.wait(d_works, f"the key gradients of rank {source} from rank {(rank - 1) % world}")
            d_k, d_v = d_k + arrived[0], d_v + arrived[1]
        d_kv = [d_k, d_v]
        if s < step.steps:
            arrived, d_works = comm.exchange(d_kv, (rank + 1) % world, (rank - 1) % world)
            comm.wait(works, f"the keys and values of rank {(source - 1) % world}")
            kv = following
    if step.steps:  # home: each rank's key gradients come back from the last rank they visited
        home, works = comm.exchange(d_kv, (rank - step.steps) % world, (rank + step.steps) % world)
        comm.wait(works, f"the key gradients of rank {rank} from rank {(rank + step.steps) % world}")
        d_kv = home
    return d_q, d_kv[0], d_kv[1], d_captured
