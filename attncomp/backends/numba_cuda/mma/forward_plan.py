"""How a tensor-core attention kernel maps onto a thread block (``mma/forward_kernel.py``).

A thread block computes ``rows`` query rows of one IR query tile (``block_q``, or fewer for
a call whose rows all fit in one thread block, as in ``simt/forward_plan.py``) with one warp per 16 rows:
the ``m16`` of ``mma.sync.m16n8k16`` (the asynchronous-copy kernel's warps: ``m_tiles`` such tiles
each).  Key tiles are the IR's (``block_k``), so tile classes and loop bounds are the IR's; a
tile is computed ``chunk`` keys at a time, fewer for larger head dims (``CHUNKS``), so that the
scores, the query and the output fragments fit in a thread's 255 registers.  Shared memory holds
one chunk of keys and of values as 32-bit words of two 16-bit elements: keys row by row
(``k_sh[key, d // 2]``), values transposed (``v_sh[e, key // 2]``), each row padded by four words
so that the eight rows a fragment load touches fall in different banks.

A spec gets these kernels where its products can run on tensor cores: query, key and value
of one 16-bit type (f16 or bf16), ``D`` a multiple of 16 (the ``k`` of a product), ``E`` a
multiple of 8 (its ``n``), ``block_k`` a multiple of 16, at least 16 rows per thread block,
and the tiles within the shared-memory budget.  Others run the scalar kernels (``simt/forward_plan.py``).

float32 query, key and value run on ``mma.sync.m16n8k8`` in tf32 (``mma/operands.py``):
``"3xtf32"`` (flash-tiling's ``precision = "exact"``, the default) splits each operand into two
tf32 parts and makes three products of them, float32-accurate; ``"tf32"`` (``precision =
"tf32"``, opt-in) makes one.  Their words are whole float32: keys row by row (``k_sh[key, d]``),
values row by row too (``v_sh[key, e]``), each row padded by four words (every pitch then puts
the eight rows and four columns a fragment load touches in different banks); ``3xtf32`` keeps a
second copy of each with the parts ``big`` missed.  They need ``D`` and ``E`` multiples of 8.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from attncomp.backends.numba_cuda.block_plan import WarpPlan
from attncomp.backends.numba_cuda.choice import KernelChoice
from attncomp.backends.numba_cuda.lanes import MAX_THREADS, WARP
from attncomp.backends.numba_cuda.mma.atoms import LDMATRIX_X4, M16N8K16

#: query rows per warp (the m of m16n8k16)
WARP_ROWS = M16N8K16.m
#: words a shared-memory row is padded by
PAD_WORDS = 4
#: keys per chunk by the largest head dim they serve: a lane holds D / 4 query and E / 4 output
#: registers, and chunk / 4 scores (``ptxas`` reports no spills at these: at D = E = 192, 16 keys a
#: chunk, 235 to 248 registers on sm_80 and sm_90, ALiBi's included; MLA's prefill is 192 and 128).
#: Head dims past 192 would spill (256: 172 bytes on sm_90): the scalar kernels run them.
CHUNKS = ((64, 64), (128, 32), (192, 16))
#: the same for float32 operands (a lane holds D / 2 query and E / 2 output registers), by
#: whether they are exact (``KernelChoice.exact``: 3xTF32) or one tf32 product.  3xTF32 past D = 64
#: spills (272 bytes at D = 128, even with the query's rests made once per chunk instead of kept):
#: those head dims run the float32 FMA kernels.
F32_CHUNKS = {False: ((64, 32), (128, 16)), True: ((64, 16),)}


@dataclass(frozen=True)
class MmaPlan(WarpPlan):
    """A warp per 16 query rows (``WarpPlan``)."""

    rows: int  # query rows per thread block
    chunk: int  # keys computed at a time (divides block_k)
    m_tiles: int = 1  # 16-row tiles a warp computes (the asynchronous-copy kernel's: ``FLASH_SHAPES``)

    @property
    def warps(self) -> int:
        return self.rows // (self.atom.m * self.m_tiles)

    @property
    def warp_rows(self) -> int:
        """Query rows a warp computes."""
        return self.atom.m * self.m_tiles

    @property
    def q_words(self) -> int:
        """Words of the shared query tile: the asynchronous-copy kernel of several tiles a warp reads its
        A fragments from it at each product (the output's and the scores' registers leave no room to
        keep them), after the same copies as keys and values."""
        return self.rows * self.head_dim // 2 if self.async_copies and self.m_tiles > 1 else 0

    @property
    def tf32(self) -> bool:
        """float32 operands on ``m16n8k8`` tf32 products (``operands.Operands``)."""
        return self.choice.tf32

    @property
    def split(self) -> bool:
        """Each operand as two tf32 parts, three products (3xTF32)."""
        return self.choice.tf32 and self.choice.exact

    @property
    def lanes(self) -> int:
        """Lanes per query row as the scalar kernel counts them: one (a row's accumulators are in
        its lanes' fragments); the split merge the writers share reads it."""
        return 1

    @property
    def async_copies(self) -> bool:
        """Keys and values staged by asynchronous copies into swizzled tiles (``mma/flash_kernel.py``)."""
        return self.choice.async_copies

    @property
    def k_pitch(self) -> int:
        """Words per row of the shared key tile (unpadded where swizzled)."""
        if self.async_copies:
            return self.head_dim // 2
        return self.head_dim // self.atom.a.per_register + PAD_WORDS

    @property
    def v_pitch(self) -> int:
        """Words per row of the shared value tile (transposed for 16-bit elements, unless swizzled)."""
        if self.async_copies:
            return self.value_dim // 2
        return self.value_dim + PAD_WORDS if self.tf32 else self.chunk // self.atom.b.per_register + PAD_WORDS

    @property
    def k_words(self) -> int:
        return self.chunk * self.k_pitch

    @property
    def v_words(self) -> int:
        return self.chunk * self.v_pitch if self.tf32 or self.async_copies else self.value_dim * self.v_pitch

    @property
    def query_rest_words(self) -> int:
        """3xTF32: the query fragments' rests, kept in shared memory (``D / 2`` registers a lane
        would spill where the score or mask computes much), each lane's in its own words."""
        atom = self.atom
        return self.warps * self.head_dim // atom.k * atom.a.registers * WARP if self.split else 0

    @property
    def shared_bytes(self) -> int:
        tiles = (self.k_words + self.v_words) * (2 if self.split else 1) + self.query_rest_words + self.q_words
        return 4 * (tiles + (1 if self.choice.key_splits else 0))  # the split merge's flag word


#: the asynchronous-copy kernel's shape by the widest head dim it serves and what its scores do per
#: element (``AttentionKernels.score_work``): (16-row tiles a warp, keys a chunk).  Two tiles a warp
#: (four warps of 32 rows a block of 128, as FlashAttention-2) share each B fragment an ldmatrix reads
#: and the chunk's copies and control; the query's A fragments are then read from its shared tile at
#: each product.  One tile a warp (eight warps of 16 rows) keeps them in registers and leaves room for
#: a longer chunk.  Measured by ``benchmarks.kernel_report`` (static SASS, sm_90, bf16 causal, the
#: one-split kernel): at D = 128 two tiles of 32 keys are 3057 instructions for 256 HMMA (11.9 a
#: HMMA; 255 registers), one tile of 64 keys 2509 (9.8; 240 registers): a row's statistics, the
#: outputs' rescaling and the finish are paid once per 16 rows, not twice.  At one tile and 64 keys
#: ALiBi takes 248 registers, a causal sliding window 242 (sm_90; no spills).  Past the shapes here a
#: kernel spills on sm_80 or sm_90: two tiles where the scores read positions (ALiBi: 16 to 524
#: bytes) or do more per element past D = 64 (soft-capping: 44 bytes at D = 128), and a decode
#: step's kernel of packed heads past 32 keys at D = 128 (``"packed"``, at most the chunk of its
#: scores: 124 bytes on sm_90).  Not past 128: a row of 192 features is 24 copies, which no block's
#: threads divide (``plan_flash``); the staged kernel serves those head dims.
FLASH_SHAPES = (
    (64, {"scale": (2, 64), "elementwise": (2, 64), "positional": (1, 64), "packed": (1, 64)}),
    (128, {"scale": (1, 64), "elementwise": (1, 64), "positional": (1, 64), "packed": (1, 32)}),
)
#: ops of a mask region (besides its yield) that still count as "scale" work, gathers none: past
#: them a mask is "elementwise" (a causal sliding window's four, sinks with a window, documents' two
#: gathers, key padding's gather), at them (causal: one; a two-sided window: three) it is not
MASK_OPS = 3
#: head dims the swizzled tiles serve: rows of whole 128-byte bank spans (eight 16-byte chunks)
FLASH_DIM = 64
#: keys per 16-byte copy row's chunk: 8 16-bit elements
COPY_ELEMENTS = 8
#: bytes of one copy and of one ldmatrix row: a 16-byte chunk of eight 16-bit elements
CHUNK_BYTES = 2 * COPY_ELEMENTS


def row_pitch(rows: str) -> str:
    """The elements from one of ``rows``'s rows to the next (a generated expression): its stride in
    bytes halved (16-bit elements, as every array the asynchronous copies read: f16, or bf16
    patterns), not divided."""
    return f"np.int32({rows}.strides[0] >> 1)"


#: rows of one swizzle pattern of the asynchronous-copy kernel's tiles: a chunk's place is
#: ``chunk ^ (row % SWIZZLE)``
SWIZZLE = LDMATRIX_X4.rows
#: the chunk index bits the swizzle changes (chunks 0 .. 7 of each 128 bytes)
SWIZZLED = SWIZZLE - 1


def swizzled(row: str, chunk: str) -> str:
    """The byte offset of 16-byte chunk ``chunk`` of row ``row`` within that row (expressions)."""
    return f"((({chunk}) ^ (({row}) & {SWIZZLED})) * {CHUNK_BYTES})"


def chunk_of(chunks: tuple[tuple[int, int], ...], block_k: int, widest: int, least: int) -> int | None:
    """Keys a chunk for the widest head dim (``chunks``: keys by the largest dim they serve), halved
    until it divides the key tile; None past the table or below ``least`` (the keys of a product)."""
    return fitted(next((c for most, c in chunks if widest <= most), 0), block_k, least)


def fitted(chunk: int, block_k: int, least: int) -> int | None:
    """``chunk`` halved until it divides the key tile; None below ``least``."""
    while chunk and block_k % chunk:
        chunk //= 2
    return chunk if chunk >= least else None


def plan_flash(
    block_q: int,
    block_k: int,
    head_dim: int,
    value_dim: int,
    choice: KernelChoice,
    rows: int,
    splits: bool = True,
    scores: str = "scale",
    packed: bool = False,
) -> MmaPlan | None:
    """The plan of the asynchronous-copy kernel (``mma/flash_kernel.py``), or None where it does not
    apply: operands kept 16-bit on the device, D and E multiples of 64, every thread making the
    same number of copies.  ``splits``: the kernel can split its keys (``KernelChoice.key_splits``);
    ``scores``: what its score region does per element (``AttentionKernels.score_work``: two tiles a
    warp or one, ``FLASH_SHAPES``); ``packed``: a decode step's grouped heads packed into the rows
    (``mma/packed_heads.py``), one tile a warp (its A fragments kept in registers)."""
    if choice.storage not in ("f16", "bits") or head_dim % FLASH_DIM or value_dim % FLASH_DIM:
        return None
    widest = max(head_dim, value_dim)
    shapes = next((shapes for most, shapes in FLASH_SHAPES if widest <= most), None)
    if shapes is None or rows % WARP_ROWS:
        return None
    tiles, chunk = shapes[scores]
    if packed:  # one tile a warp, its A fragments kept
        tiles, chunk = 1, min(chunk, shapes["packed"][1])
    chunk = fitted(chunk, block_k, M16N8K16.k)
    if chunk is None:
        return None
    flash = replace(choice, async_copies=True, key_splits=splits, packed_heads=packed)
    if tiles > 1 and rows % (WARP_ROWS * tiles) == 0:
        plan = flash_copies(MmaPlan(block_q, block_k, head_dim, value_dim, flash, rows, chunk, tiles))
        if plan is not None:
            return plan
    return flash_copies(MmaPlan(block_q, block_k, head_dim, value_dim, flash, rows, chunk))


def flash_copies(plan: MmaPlan) -> MmaPlan | None:
    """``plan`` where its threads can share the copies evenly, and it fits."""
    chunk, rows, head_dim, value_dim = plan.chunk, plan.rows, plan.head_dim, plan.value_dim
    # a thread's copies are one column of whole rows: the threads a multiple of a row's copies, and
    # every thread making as many (of the query's rows too, where it is copied)
    copied = [(chunk, head_dim), (chunk, value_dim)] + ([(rows, head_dim)] if plan.q_words else [])
    uneven = any(plan.threads % (dim // COPY_ELEMENTS) or n * dim // COPY_ELEMENTS % plan.threads for n, dim in copied)
    if uneven or plan.threads > MAX_THREADS or not plan.fits:
        return None
    return plan


def plan_mma(
    block_q: int,
    block_k: int,
    head_dim: int,
    value_dim: int,
    choice: KernelChoice,
    rows: int,
) -> MmaPlan | None:
    """The tensor-core plan of ``choice`` for these sizes, or None where the scalar kernels must run
    them (``choice`` is not on tensor cores, or the sizes do not fit)."""
    atom = choice.atom
    if atom is None:
        return None
    chunks = F32_CHUNKS[choice.exact] if choice.tf32 else CHUNKS
    if rows % WARP_ROWS or block_k % M16N8K16.k:  # key tiles of whole 16-bit products, either kind
        return None
    if head_dim <= 0 or head_dim % atom.k or value_dim <= 0 or value_dim % atom.n:
        return None
    chunk = chunk_of(chunks, block_k, max(head_dim, value_dim), atom.k)
    if chunk is None:
        return None
    plan = MmaPlan(block_q, block_k, head_dim, value_dim, choice, rows, chunk)
    if plan.threads > MAX_THREADS or not plan.fits:
        return None
    return plan
