"""How the query-major dQ kernel of a deterministic backward (``simt/dq_kernel.py``) maps onto a thread block.

A thread block owns ``rows`` consecutive query rows of one IR query block (a block of ``block_q``
rows is split over ``ceil(block_q / rows)`` thread blocks, never straddling two IR blocks, so the
IR's tile classes hold for every part).  Each row is owned by ``lanes`` consecutive threads: lane
``g`` keeps the entries ``g, g + lanes, ...`` of its row's dQ in registers (at most ``MAX_SLICE``),
and computes the scores of the keys ``g, g + lanes, ...`` of each chunk.

The query and output-gradient rows stay in shared memory for the whole kernel; keys and values
pass through it ``keys`` at a time, with the chunk's ``dS`` (rows by keys).  Rows are padded by one
element (``pitch``) so that the threads of a warp, which read one column of several rows, hit
different banks.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from attncomp.backends.numba_cuda.block_plan import LanePlan
from attncomp.backends.numba_cuda.lanes import MAX_THREADS, ceil_div, choose_lanes

#: registers per thread for the dQ slice
MAX_SLICE = 16
#: query rows per thread block, at most
MAX_ROWS = 64
#: keys staged at a time: at most, and the fewest before the rows are cut instead
MAX_KEYS = 64
MIN_KEYS = 16


@dataclass(frozen=True)
class DqPlan(LanePlan):
    """``lanes`` threads per query row (``LanePlan``), ``parts`` thread blocks per IR query block."""

    rows: int  # query rows per thread block (a part of one IR query block)
    keys: int  # keys staged in shared memory at a time
    acc_bytes: int  # 4 (float32 accumulation) or 8 (float64 specs)

    @property
    def head_pitch(self) -> int:
        return max(self.head_dim + 1, self.head_pad)

    @property
    def value_pitch(self) -> int:
        return self.value_dim + 1

    @property
    def ds_pitch(self) -> int:
        return self.keys + 1

    @property
    def shared_bytes(self) -> int:
        staged = (self.rows + self.keys) * (self.head_pitch + self.value_pitch) + self.rows * self.ds_pitch
        return self.acc_bytes * staged


def plan_dq(block_q: int, block_k: int, head_dim: int, value_dim: int, acc_bytes: int = 4) -> DqPlan:
    """The dQ kernel's plan for these block sizes and head dims."""
    rows = min(block_q, MAX_ROWS)
    lanes = choose_lanes(head_dim, head_dim, MAX_SLICE, rows, None, "cuda backward dq: lanes per row")
    while rows * lanes > MAX_THREADS:
        rows = ceil_div(rows, 2)
    plan = DqPlan(block_q, block_k, head_dim, value_dim, lanes, rows, min(block_k, MAX_KEYS), acc_bytes)
    while not plan.fits and plan.keys > MIN_KEYS:
        plan = replace(plan, keys=ceil_div(plan.keys, 2))
    while not plan.fits and plan.rows > 1:
        plan = replace(plan, rows=ceil_div(plan.rows, 2))
    while not plan.fits and plan.keys > 1:
        plan = replace(plan, keys=ceil_div(plan.keys, 2))
    return plan.within_budget("cuda backward dq")
