"""How the backward kernel of one ``ac.key_grid`` maps onto a thread block.

A thread block owns ``keys`` consecutive keys of one IR key block (a key
block of ``block_k`` keys is split over ``ceil(block_k / keys)`` thread
blocks when its tiles would not fit in shared memory at once; a split never
straddles two IR key blocks, so the IR's tile classes hold for every part).
Each key is owned by ``lanes`` consecutive threads: lane ``g`` keeps the
entries ``g, g + lanes, ...`` of the key's ``dk`` and ``dv`` rows in
registers (at most ``MAX_SLICE`` of each), whatever the head dims.

The key and value rows of the block stay in shared memory for the whole
kernel; the query, output-gradient, probability and score-gradient rows
pass through shared memory ``rows`` query rows at a time.  Rows are padded
by one element (``pitch``) so that the threads of a warp, which read one
column of several rows, hit different banks, and at least to the lanes' padded
features (zeros), which every lane reads when the head is narrower than its lanes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from attncomp.backends.numba_cuda.block_plan import LanePlan
from attncomp.backends.numba_cuda.lanes import MAX_THREADS, ceil_div, choose_lanes

#: registers per thread for the dk slice, and again for the dv slice
MAX_SLICE = 16
#: keys per thread block, at most
MAX_KEYS = 64
#: query rows staged at a time, at most
MAX_ROWS = 8


@dataclass(frozen=True)
class BackwardPlan(LanePlan):
    """``lanes`` threads per key (``LanePlan``), ``parts`` thread blocks per IR key block."""

    OWNERS = "keys"

    keys: int  # keys per thread block (a part of one IR key block)
    rows: int  # query rows staged in shared memory at a time
    acc_bytes: int  # 4 (float32 accumulation) or 8 (float64 specs)
    #: a deterministic kernel's shared memory for the sites' ordered sums: bytes per staged (row, key)
    #: element, and whether each thread's sum has a word to be added up in thread order
    site_bytes: int = 0
    thread_sums: bool = False

    @property
    def halves(self) -> int:
        """Thread blocks sharing one part's keys (each keeps all of their columns)."""
        return 1

    @property
    def head_pitch(self) -> int:
        return max(self.head_dim + 1, self.head_pad)

    @property
    def value_pitch(self) -> int:
        return max(self.value_dim + 1, self.value_pad)

    @property
    def shared_bytes(self) -> int:
        staged = self.keys * (self.head_pitch + self.value_pitch) + self.rows * (self.head_pitch + self.value_pitch)
        sites = self.site_bytes * self.rows * self.keys + (self.acc_bytes * self.threads if self.thread_sums else 0)
        return self.acc_bytes * (staged + 2 * self.rows * self.keys) + sites


def plan_backward(
    block_q: int,
    block_k: int,
    head_dim: int,
    value_dim: int,
    acc_bytes: int = 4,
    lanes: int | None = None,
    site_bytes: int = 0,
    thread_sums: bool = False,
) -> BackwardPlan:
    """The plan for these block sizes and head dims; ``lanes`` overrides the choice (tests use it);
    ``site_bytes`` and ``thread_sums``: the shared memory of a deterministic kernel's site sums."""
    keys = min(block_k, MAX_KEYS)
    lanes = choose_lanes(head_dim, value_dim, MAX_SLICE, keys, lanes, "cuda backward: lanes per key")
    while keys * lanes > MAX_THREADS:
        keys = ceil_div(keys, 2)
    rows = min(block_q, max(MAX_ROWS, lanes))
    plan = BackwardPlan(block_q, block_k, head_dim, value_dim, lanes, keys, rows, acc_bytes, site_bytes, thread_sums)
    while not plan.fits and plan.keys > 1:
        plan = replace(plan, keys=ceil_div(plan.keys, 2))
    while not plan.fits and plan.rows > 1:
        plan = replace(plan, rows=plan.rows // 2)
    return plan.within_budget("cuda backward")
