"""How a tensor-core attention kernel maps onto a thread block (``mma_kernel.py``).

A thread block computes ``rows`` query rows of one IR query tile (``block_q``, or fewer for
a call whose rows all fit in one thread block, as in ``plan.py``) with one warp per 16 rows:
the ``m16`` of ``mma.sync.m16n8k16``.  Key tiles are the IR's (``block_k``), so tile classes
and loop bounds are the IR's; a tile is computed ``chunk`` keys at a time, fewer for larger
head dims (``CHUNKS``), so that the scores, the query and the output fragments fit in a
thread's 255 registers.  Shared memory holds one chunk of keys and of values as 32-bit words
of two 16-bit elements: keys row by row (``k_sh[key, d // 2]``), values transposed
(``v_sh[e, key // 2]``), each row padded by four words so that the eight rows a fragment load
touches fall in different banks.

A spec gets these kernels where its products can run on tensor cores: query, key and value
of one 16-bit type (f16 or bf16), ``D`` a multiple of 16 (the ``k`` of a product), ``E`` a
multiple of 8 (its ``n``), ``block_k`` a multiple of 16, at least 16 rows per thread block,
and the tiles within the shared-memory budget.  Others run the scalar kernels (``plan.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from attncomp.backends.numba_cuda.lanes import MAX_THREADS, SHARED_BUDGET, WARP

#: query rows per warp (the m of m16n8k16)
WARP_ROWS = 16
#: words a shared-memory row is padded by
PAD_WORDS = 4
#: the element types tensor cores multiply (with float32 accumulation)
ELEMENTS = ("f16", "bf16")
#: keys per chunk by the largest head dim they serve: a lane holds D / 4 query and E / 4 output
#: registers, and chunk / 4 scores (``ptxas`` reports no spills at these, see the PTX tests).
#: Head dims past 128 would spill (64 query and 128 output registers at 256): the scalar kernels
#: run them.
CHUNKS = ((64, 64), (128, 32))


@dataclass(frozen=True)
class MmaPlan:
    block_q: int  # query rows of the IR's tile
    block_k: int  # keys of the IR's tile
    head_dim: int  # D
    value_dim: int  # E
    element: str  # the products' type: "f16" or "bf16"
    #: how the query, key and value arrays hold it on the device: "f16"; "bits" (bf16 as its 16-bit
    #: patterns, uint16 or int16); "f32" (bf16 widened, ``numba_cuda.widened``)
    storage: str
    rows: int  # query rows per thread block
    chunk: int  # keys computed at a time (divides block_k)

    @property
    def warps(self) -> int:
        return self.rows // WARP_ROWS

    @property
    def threads(self) -> int:
        return self.warps * WARP

    @property
    def k_pitch(self) -> int:
        """Words per row of the shared key tile."""
        return self.head_dim // 2 + PAD_WORDS

    @property
    def v_pitch(self) -> int:
        """Words per row of the shared (transposed) value tile."""
        return self.chunk // 2 + PAD_WORDS

    @property
    def shared_bytes(self) -> int:
        return 4 * (self.chunk * self.k_pitch + self.value_dim * self.v_pitch)


def plan_mma(
    block_q: int, block_k: int, head_dim: int, value_dim: int, element: str | None, storage: str, rows: int
) -> MmaPlan | None:
    """The tensor-core plan for these sizes, or None where the scalar kernels must run them."""
    if element not in ELEMENTS or rows % WARP_ROWS or block_k % 16:
        return None
    if head_dim <= 0 or head_dim % 16 or value_dim <= 0 or value_dim % 8:
        return None
    widest = max(head_dim, value_dim)
    chunk = next((c for most, c in CHUNKS if widest <= most), 0)
    while chunk and block_k % chunk:
        chunk //= 2
    if chunk < 16:
        return None
    plan = MmaPlan(block_q, block_k, head_dim, value_dim, element, storage, rows, chunk)
    if plan.threads > MAX_THREADS or plan.shared_bytes > SHARED_BUDGET:
        return None
    return plan
