"""How the asynchronous-copy tensor-core backward (``mma/flash_backward.py``) maps onto a thread block.

As the staged backward (``mma/backward_plan.py``): a thread block owns ``keys`` consecutive keys of
one IR key block, ``split`` warps for each 16 of them, and takes the query rows ``rows`` at a time.  Every tile
is kept as the arrays hold it, row by row of 16-bit elements, each row padded by one 16-byte chunk
(:data:`PAD_BYTES`): rows ``2 D + 16`` bytes apart fall an odd number of chunks apart, so the eight
rows an ``ldmatrix`` phase reads sit in eight distinct 16-byte bank groups when D is a multiple of
16, with no swizzle and one address register a lane per tile and pattern.  ``ds`` holds dS
transposed, keys by query rows, as the products leave it:

    k   [keys][D]       A of S^T = K Q^T (ldmatrix);       B of dQ = dS K (ldmatrix.trans)
    v   [keys][E]       A of dP^T = V dO^T (ldmatrix)
    q   [rows][D]       B of S^T (ldmatrix);                B of dK += dS^T Q (ldmatrix.trans)
    o   [rows][E]       B of dP^T (ldmatrix);               B of dV += P^T dO (ldmatrix.trans)
    ds  [keys][rows]    A of dQ (ldmatrix.trans); with a split, A of dK += dS^T Q (ldmatrix)
    p   [keys][rows]    with a split: A of dV += P^T dO (ldmatrix)

One thread block owns its keys' whole dK and dV columns: no products are made twice.  The shapes
are data, :data:`FLASH_BACKWARD_SHAPES`: (keys, rows, split) by the widest head dim, within the
static shared-memory budget (48 KiB) and the registers (a warp's dK and dV fragments are
``D / 2 / split`` and ``E / 2 / split`` float32 a lane).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from attncomp.backends.numba_cuda.choice import KernelChoice
from attncomp.backends.numba_cuda.lanes import MAX_THREADS
from attncomp.backends.numba_cuda.mma.atoms import M16N8K16
from attncomp.backends.numba_cuda.mma.backward_plan import MmaBackwardPlan
from attncomp.backends.numba_cuda.mma.forward_plan import CHUNK_BYTES, COPY_ELEMENTS

#: the bytes past each row of a tile: one 16-byte chunk (see the module)
PAD_BYTES = CHUNK_BYTES
#: (widest head dim served, (keys, query rows, split)) a thread block, ``split`` warps per 16 keys
#: (``FlashBackwardPlan.split``).  Up to D = 64: 64 keys, 32 rows, four warps, 34,048 bytes of
#: shared memory (64 rows spill a few registers).  Up to 128: 32 keys, 32 rows, two warps a key
#: group, each half the rows' scores and half the dK and dV columns (a lane's whole columns,
#: D / 2 + E / 2 float32, leave too few registers), 40,192 bytes
FLASH_BACKWARD_SHAPES = ((64, (64, 32, 1)), (128, (32, 32, 2)))
#: (widest head dim served, query rows a thread block) of a deterministic backward's dQ pass
#: (``mma/deterministic.py``): no dK and dV fragments beside its own, so up to D = 64 a block takes
#: 64 rows (twice the products for each chunk of keys copied); past it, the key-major kernel's 32
FLASH_DQ_ROWS = ((64, 64), (128, 32))
#: consecutive threads that copy one 16-byte chunk of as many consecutive rows (a quarter-warp)
COPY_GROUP = 8
#: query rows of float32 scores a lane holds at once (``FlashBackwardPlan.live_rows``)
LIVE_ROWS = 32
#: head dims the tiles serve: whole 16-column pairs of fragments (one ``ldmatrix.x4``)
FLASH_BACKWARD_DIM = 16


def pitch(elements: int) -> int:
    """Bytes from one row of a tile to the next: its 16-bit elements and the pad."""
    return 2 * elements + PAD_BYTES


@dataclass(frozen=True)
class FlashBackwardPlan(MmaBackwardPlan):
    """The asynchronous-copy backward's plan: ``keys`` a thread block, query rows ``rows`` a chunk,
    ``split`` warps for each 16 keys (``halves`` 1: no product made twice).  With a split, warp ``w``
    takes key group ``w % (keys / 16)`` and part ``w // (keys / 16)``: that part of the chunk's rows
    for ``S^T``, ``dP^T`` and their elements, and that part of the dK and dV columns, the P and dS
    the other warps made read from shared memory."""

    split: int = 1

    @property
    def warps(self) -> int:
        return self.keys // M16N8K16.m * self.split

    @property
    def key_warps(self) -> int:
        """Warps a row part (the key groups)."""
        return self.keys // M16N8K16.m

    @property
    def warp_rows(self) -> int:
        """Query rows of a chunk whose scores a warp computes."""
        return self.rows // self.split

    @property
    def d_share(self) -> int:
        """dK columns a warp accumulates."""
        return self.head_dim // self.split

    @property
    def e_share(self) -> int:
        """dV columns a warp accumulates."""
        return self.value_dim // self.split

    @property
    def k_pitch(self) -> int:
        """Bytes a row of the key and query tiles."""
        return pitch(self.head_dim)

    @property
    def v_pitch(self) -> int:
        """Bytes a row of the value and output-gradient tiles."""
        return pitch(self.value_dim)

    @property
    def ds_pitch(self) -> int:
        """Bytes a row (a key) of dS transposed."""
        return pitch(self.rows)

    @property
    def tile_bytes(self) -> dict[str, int]:
        """Each shared tile's bytes, by name."""
        return {
            "k": self.keys * self.k_pitch,
            "v": self.keys * self.v_pitch,
            "q": self.rows * self.k_pitch,
            "o": self.rows * self.v_pitch,
            "ds": self.keys * self.ds_pitch,
            **({"p": self.keys * self.ds_pitch} if self.split > 1 else {}),  # P^T, the other warps' too
        }

    @property
    def tile_at(self) -> dict[str, int]:
        """Each tile's first byte in the one shared array (``sh``), by name."""
        at, found = 0, {}
        for name, size in self.tile_bytes.items():
            found[name] = at
            at += size
        return found

    @property
    def words(self) -> int:
        """32-bit words of the shared array (the tiles)."""
        return sum(self.tile_bytes.values()) // 4

    @property
    def shared_bytes(self) -> int:
        """The shared array, and the chunk's log-sum-exp and delta (float32)."""
        return 4 * self.words + 4 * 2 * self.rows

    @property
    def live_rows(self) -> int:
        """Query rows whose float32 ``S^T`` and ``dP^T`` a lane holds at once (:data:`LIVE_ROWS`, or the
        chunk): the products and elements go a group of them at a time, each packed to 16 bits as it
        is done, so that a chunk of 64 rows fits the registers beside dK and dV."""
        return min(self.warp_rows, LIVE_ROWS)

    @property
    def m_tiles(self) -> int:
        """16-row tiles of a chunk's query rows (the m of dQ's products)."""
        return self.rows // M16N8K16.m

    @property
    def dq_groups(self) -> int:
        """Warps sharing one 16-row tile of dQ, each a run of its columns (1: a warp takes whole rows)."""
        return max(self.warps // self.m_tiles, 1)

    @property
    def dq_columns(self) -> int:
        """dQ columns a warp computes of each of its 16-row tiles."""
        return self.head_dim // self.dq_groups

    @property
    def dq_row_tiles(self) -> int:
        """16-row tiles of dQ a warp computes each chunk."""
        return max(self.m_tiles // self.warps, 1)

    def copies(self, rows: int, dim: int) -> int | None:
        """16-byte copies a thread makes of ``rows`` rows of ``dim`` features: None where the block's
        threads do not share them evenly in the order of :meth:`copy_steps`."""
        per_row, groups = dim // COPY_ELEMENTS, self.threads // COPY_GROUP
        if (groups % per_row and per_row % groups) or rows * per_row % (COPY_GROUP * max(groups, per_row)):
            return None
        return rows * per_row // self.threads

    def copy_steps(self, rows: int, dim: int) -> list[tuple[int, int]]:
        """(rows, 16-byte chunks) from a thread's first copy to each of its copies of ``rows`` rows of
        ``dim`` features.  Each eight consecutive threads copy one chunk of eight consecutive rows
        (:data:`COPY_GROUP`), so that a quarter-warp's stores fall in distinct banks (the padded
        rows) whatever the row's length; the eight-thread groups take a row's chunks in turn.  Thread
        ``t`` starts at row ``8 (t // 8 // per_row) + t % 8``, chunk ``t // 8 % per_row``."""
        per_row, groups = dim // COPY_ELEMENTS, self.threads // COPY_GROUP
        steps = []
        for n in range(self.copies(rows, dim) or 0):
            if groups >= per_row:  # a step of the block covers whole rows: rows move, chunks stay
                steps.append((n * COPY_GROUP * (groups // per_row), 0))
            else:  # a step covers part of the rows' chunks: chunks move, then rows
                turns = per_row // groups
                steps.append((COPY_GROUP * (n // turns), (n % turns) * groups))
        return steps


def plan_flash_backward(
    block_q: int, block_k: int, head_dim: int, value_dim: int, choice: KernelChoice
) -> FlashBackwardPlan | None:
    """The asynchronous-copy backward's plan, or None where it does not apply: operands of one 16-bit
    type kept 16-bit on the device, D and E multiples of 16 within the table, the keys and rows
    dividing the IR's blocks, every thread making as many copies, the warps sharing dQ evenly."""
    if choice.atom is None or choice.tf32 or choice.storage not in ("f16", "bits"):
        return None
    if min(head_dim, value_dim) <= 0 or head_dim % FLASH_BACKWARD_DIM or value_dim % FLASH_BACKWARD_DIM:
        return None
    widest = max(head_dim, value_dim)
    shape = next((shape for most, shape in FLASH_BACKWARD_SHAPES if widest <= most), None)
    if shape is None:
        return None
    keys, rows, split = shape
    m = M16N8K16.m
    while keys >= m and block_k % keys:
        keys //= 2
    while rows >= m and block_q % rows:
        rows //= 2
    if keys < m or rows < m * split:
        return None
    flash = replace(choice, async_copies=True)
    sizes = (block_q, block_k, head_dim, value_dim)
    plan = FlashBackwardPlan(*sizes, flash, keys, rows, split=split)
    even = plan.m_tiles % plan.warps == 0 or plan.warps % plan.m_tiles == 0
    # a warp's dQ, dK and dV columns: whole pairs of 8 (one ldmatrix.x4.trans each)
    pairs = all(cols % (2 * M16N8K16.n) == 0 for cols in (plan.dq_columns, plan.d_share, plan.e_share))
    copied = [(keys, head_dim), (keys, value_dim), (rows, head_dim), (rows, value_dim)]
    if not (even and pairs) or any(plan.copies(*c) is None for c in copied):
        return None
    return plan if plan.threads <= MAX_THREADS and plan.fits else None


def plan_flash_dq(plan: FlashBackwardPlan) -> FlashBackwardPlan:
    """The plan of a deterministic backward's dQ pass over ``plan``'s keys: ``plan`` with the rows of
    :data:`FLASH_DQ_ROWS` where they divide the IR's query block and the copies, warps and shared
    memory allow, else ``plan`` itself."""
    widest = max(plan.head_dim, plan.value_dim)
    rows = next(rows for most, rows in FLASH_DQ_ROWS if widest <= most)
    wider = replace(plan, rows=rows)
    even = wider.m_tiles % wider.warps == 0 or wider.warps % wider.m_tiles == 0
    pairs = wider.dq_columns % (2 * M16N8K16.n) == 0
    copied = all(wider.copies(rows, dim) is not None for dim in (plan.head_dim, plan.value_dim))
    if rows <= plan.rows or plan.block_q % rows or not (even and pairs and copied and wider.fits):
        return plan
    return wider
