"""How one attention kernel maps onto a thread block: lanes, key chunks, shared memory.

A thread block computes ``rows`` query rows: the IR's whole block of
``block_q`` rows, or, when a call has fewer query rows than that (decoding
a few tokens), just enough for them, so that no thread block computes
clamped copies of one row over and over.  Each row is owned by ``lanes``
consecutive threads; lane ``g`` keeps the head-dimension
entries ``g, g + lanes, g + 2 lanes, ...`` of its row's query and of its
output accumulator in registers, so a thread holds at most
``MAX_SLICE`` of each, whatever the head dimension; a block of few rows takes more lanes per
row, so that it still has a warp of threads.  Interleaving the lanes
(rather than giving each a contiguous range) makes the lanes of a warp read
consecutive words of a shared-memory row: no bank conflicts.

Keys and values are staged in shared memory ``chunk`` keys at a time (a
chunk never straddles two IR tiles, so tile classes are kept exactly).  When
a row has several lanes, their partial dot products meet in a shared
``partials[chunk, threads + 1]`` buffer: Numba's CUDA simulator has no warp
shuffles, and exchanging through shared memory keeps one kernel for the
simulator and the GPU.  The row is one word longer than the block's threads
(:attr:`AttentionPlan.partials_width`): lane ``g`` sums key ``g``'s partials,
so the lanes of a row read ``lanes`` different rows of the buffer at once;
with rows of ``threads`` words (a multiple of the 32 banks) those reads would
all fall in one bank (a decoding block's 32 lanes: 16-way conflicts on every
read), and one more word a row puts them in 32 different banks.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from attncomp.backends.numba_cuda.block_plan import LanePlan
from attncomp.backends.numba_cuda.lanes import MAX_THREADS, choose_lanes
from attncomp.backends.tiles import LoweringError

#: registers per thread for the query slice, and again for the accumulator slice
MAX_SLICE = 32
#: keys staged per chunk, at most (the scores of a chunk are registers too)
MAX_CHUNK = 16


@dataclass(frozen=True)
class AttentionPlan(LanePlan):
    """``lanes`` threads per query row (``LanePlan``)."""

    chunk: int  # keys staged in shared memory at a time
    acc_bytes: int  # 4 (float32 accumulation) or 8 (float64 specs)
    rows: int  # query rows per thread block: block_q, or fewer for calls with fewer rows

    @property
    def partials_width(self) -> int:
        """The words of a row of the ``partials`` buffer: the block's threads and one of padding."""
        return self.threads + 1

    @property
    def shared_bytes(self) -> int:
        partials = self.chunk * self.partials_width if self.lanes > 1 else 0
        scores = self.chunk * self.rows
        return self.acc_bytes * (self.chunk * (self.head_pad + self.value_pad) + partials + scores)


def rows_for(block_q: int, n_rows: int) -> int:
    """Query rows per thread block for a call with ``n_rows`` rows: the IR's ``block_q``, or the
    power of two that just holds them when there are fewer (one thread block then covers them all)."""
    rows = 1
    while rows < min(n_rows, block_q):
        rows *= 2
    return min(rows, block_q)


def plan_attention(
    block_q: int,
    block_k: int,
    head_dim: int,
    value_dim: int,
    acc_bytes: int = 4,
    lanes: int | None = None,
    rows: int | None = None,
) -> AttentionPlan:
    """The plan for these block sizes and head dims; ``lanes`` overrides the choice (tests use it).

    ``rows`` (default ``block_q``) is the query rows a thread block computes; fewer than
    ``block_q`` is only right when the call's rows all fit in one thread block.
    """
    rows = block_q if rows is None else rows
    if not 1 <= rows <= block_q:
        raise LoweringError(f"cuda: rows per thread block must be in [1, block_q = {block_q}], got {rows}")
    lanes = choose_lanes(head_dim, value_dim, MAX_SLICE, rows, lanes, "cuda: lanes per row")
    if rows * lanes > MAX_THREADS:
        raise LoweringError(
            f"cuda: block_q = {rows} with {lanes} threads per row needs {rows * lanes} threads "
            f"(at most {MAX_THREADS}); use a smaller block_q in flash-tiling"
        )
    chunk = max(1, min(MAX_CHUNK, block_k))
    plan = AttentionPlan(block_q, block_k, head_dim, value_dim, lanes, chunk, acc_bytes, rows)
    while not plan.fits and plan.chunk > 1:
        plan = replace(plan, chunk=plan.chunk // 2)
    return plan.within_budget("cuda")
