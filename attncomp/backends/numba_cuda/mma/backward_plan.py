"""How a tensor-core backward kernel (``mma/backward_kernel.py``) maps onto a thread block.

A thread block owns ``keys`` consecutive keys of one IR key block, one warp per 16 of them (the
``m16`` of ``mma.sync.m16n8k16``: the backward's products put keys on the rows of ``S^T``,
``dP^T``, ``dK`` and ``dV``), and takes the query rows of each tile ``rows`` at a time.  Every
operand of a product comes from shared memory as 32-bit words of two 16-bit elements, rows padded
by four words (the eight rows a fragment load touches fall in different banks):

    k_sh  [keys][D/2]    keys, features paired       A of S^T = K Q^T
    v_sh  [keys][E/2]    values, features paired     A of dP^T = V dO^T
    kt_sh [D][keys/2]    keys transposed             B of dQ = dS K
    q_sh  [rows][D/2]    query rows                  B of S^T
    o_sh  [rows][E/2]    output-gradient rows        B of dP^T
    qt_sh [D][rows/2]    query rows transposed       B of dK += dS^T Q
    ot_sh [E][rows/2]    output gradient transposed  B of dV += P^T dO
    ds_sh [rows][keys/2] dS, keys paired             A of dQ (over q_sh: q_sh is read before it)

Keys and values stay for the whole kernel; the others are staged per chunk of query rows.  The
transposed tiles are made from the staged ones in shared memory (16-bit halves traded), so each
element is read from global memory once.  A lane
keeps its keys' ``dK`` and ``dV`` fragments in registers (``D / 2`` and ``E / 2`` float32) and the
chunk's ``S^T`` and ``dP^T`` (``rows / 2`` each); ``dQ`` is summed over the block's keys by the
products and added to the output with float32 atomics, as FlashAttention-2 does.

``KEYS_ROWS`` gives (keys, rows, halves) by the widest head dim: 64 keys and 32 rows up to 64
features; 32 keys and 16 rows up to 128, where two thread blocks share each set of keys, one for
each half of the dK, dV and dQ columns.  Each then keeps D / 4 + E / 4 float32 accumulators
instead of D / 2 + E / 2: whole columns at D = E = 128 sat at 255 registers and spilled on some
specs.  Both blocks compute the whole ``S^T`` and ``dP^T`` (their products over D and E): seven
products' work per tile instead of five, traded for no spills.  A spec gets
these kernels where its query, key, value and output gradient are one 16-bit type, ``D`` and ``E``
multiples of 16, and ``block_q`` and ``block_k`` multiples of 16; others run the scalar backward
(``simt/backward_plan.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from attncomp.backends.numba_cuda.block_plan import WarpPlan
from attncomp.backends.numba_cuda.choice import KernelChoice
from attncomp.backends.numba_cuda.mma.atoms import M16N8K8_TF32, M16N8K16
from attncomp.backends.numba_cuda.mma.forward_plan import PAD_WORDS

#: (keys, query rows, halves) per thread block by the widest head dim they serve
KEYS_ROWS = ((64, 64, 32, 1), (128, 32, 16, 2))


@dataclass(frozen=True)
class MmaBackwardPlan(WarpPlan):
    """A warp per 16 keys (``WarpPlan``), ``parts`` thread blocks per IR key block (the keys divide
    it); storage "f16", or "f32": float32, or bf16 widened."""

    OWNERS = "keys"

    keys: int  # keys per thread block (a part of one IR key block)
    rows: int  # query rows per chunk
    halves: int = 1  # thread blocks sharing the keys, each the dK, dV and dQ columns of its share

    @property
    def query_parts(self) -> int:
        """Thread blocks an IR query block of a query-major pass over this plan's tiles (a
        deterministic backward's dQ kernel, ``mma/deterministic.py``): ``rows`` rows each."""
        return self.block_q // self.rows

    @property
    def d_share(self) -> int:
        """The dK and dQ columns a thread block computes (of D)."""
        return self.head_dim // self.halves

    @property
    def e_share(self) -> int:
        """The dV columns a thread block computes (of E)."""
        return self.value_dim // self.halves

    @property
    def per_word(self) -> int:
        """Elements per 32-bit shared word: two 16-bit ones, or one tf32."""
        return self.atom.a.per_register

    # words per row of each shared tile
    @property
    def k_pitch(self) -> int:
        return self.head_dim // self.per_word + PAD_WORDS

    @property
    def v_pitch(self) -> int:
        return self.value_dim // self.per_word + PAD_WORDS

    @property
    def kt_pitch(self) -> int:
        """Words per row of the transposed keys and of dS (rows by keys)."""
        return self.keys // self.per_word + PAD_WORDS

    @property
    def rt_pitch(self) -> int:
        """Words per row of the transposed query and output-gradient tiles."""
        return self.rows // M16N8K16.b.per_register + PAD_WORDS

    @property
    def layout(self) -> dict[str, int]:
        """Each tile's first word in the one shared array (``ds`` over ``q``), and ``"words"``, the total."""
        if self.choice.tf32:  # no transposed tiles: fragments read rows and columns alike
            sizes = {
                "k": self.keys * self.k_pitch,
                "v": self.keys * self.v_pitch,
                "q": self.rows * self.k_pitch,
                "o": self.rows * self.v_pitch,
            }
            return self._placed(sizes)
        sizes = {
            "k": self.keys * self.k_pitch,
            "v": self.keys * self.v_pitch,
            "kt": self.d_share * self.kt_pitch,
            "q": self.rows * self.k_pitch,
            "o": self.rows * self.v_pitch,
            "qt": self.d_share * self.rt_pitch,
            "ot": self.e_share * self.rt_pitch,
        }
        return self._placed(sizes)

    def _placed(self, sizes: dict[str, int]) -> dict[str, int]:
        """The tiles one after another, ``ds`` over ``q`` where it fits."""
        at, offsets = 0, {}
        for name, size in sizes.items():
            offsets[name] = at
            at += size
        if self.rows * self.kt_pitch <= sizes["q"]:
            offsets["ds"] = offsets["q"]
        else:
            offsets["ds"] = at
            at += self.rows * self.kt_pitch
        offsets["words"] = at
        return offsets

    @property
    def shared_bytes(self) -> int:
        """The word array, and the chunk's log-sum-exp and delta (float32)."""
        return 4 * (self.layout["words"] + 2 * self.rows)

    @property
    def dq_fragments(self) -> int:
        """The 16 x 8 fragments of a chunk's dQ each warp computes."""
        return self.dq_tiles // self.warps

    @property
    def dq_tiles(self) -> int:
        """The m x n fragments of a chunk's dQ (shared out among the warps)."""
        return self.rows // self.atom.m * (self.d_share // self.atom.n)


@dataclass(frozen=True)
class DqPassPlan(MmaBackwardPlan):
    """A deterministic backward's query-major dQ pass on the staged tiles (``mma/deterministic.py``):
    the same tiles, ``ds`` never over ``q``, whose rows stay for the whole kernel."""

    def _placed(self, sizes: dict[str, int]) -> dict[str, int]:
        offsets = super()._placed(sizes)
        if offsets["ds"] == offsets["q"]:
            offsets["ds"] = offsets["words"]
            offsets["words"] += self.rows * self.kt_pitch
        return offsets


def staged_dq_plan(plan: MmaBackwardPlan) -> DqPassPlan | None:
    """``plan``'s tiles for the query-major dQ pass, or None where they exceed the shared memory."""
    found = DqPassPlan(*(getattr(plan, f.name) for f in fields(plan)))
    return found if found.fits else None


#: float32 on tf32 tensor cores: (keys, rows) up to head dims of 64 (whole float32 words in shared
#: memory: larger head dims leave no room), no halves
TF32_KEYS_ROWS = (64, 16)


def plan_mma_backward(
    block_q: int, block_k: int, head_dim: int, value_dim: int, choice: KernelChoice
) -> MmaBackwardPlan | None:
    """The tensor-core backward plan of ``choice`` for these sizes, or None where the scalar kernel
    must run them (``choice`` is not on tensor cores, or the sizes do not fit)."""
    if choice.atom is None:
        return None
    if choice.tf32:
        return plan_tf32_backward(block_q, block_k, head_dim, value_dim, choice)
    k = choice.atom.k  # keys (rows of S^T), query rows, D and E are each the k of some product
    if block_q % k or block_k % k:
        return None
    if head_dim <= 0 or head_dim % k or value_dim <= 0 or value_dim % k:
        return None
    widest = max(head_dim, value_dim)
    fit = next(((keys, rows, halves) for most, keys, rows, halves in KEYS_ROWS if widest <= most), None)
    if fit is None:
        return None
    return _fitted(MmaBackwardPlan(block_q, block_k, head_dim, value_dim, choice, *fit))


def plan_tf32_backward(
    block_q: int, block_k: int, head_dim: int, value_dim: int, choice: KernelChoice
) -> MmaBackwardPlan | None:
    """The plan of float32 gradients on ``mma.sync.m16n8k8`` in tf32: one product (flash-tiling's
    ``precision = "tf32"``) or three of split operands (``choice.exact``, ``"exact"``); D and E
    multiples of 8 up to 64, blocks multiples of 16; None: the scalar kernel."""
    m, k = M16N8K8_TF32.m, M16N8K8_TF32.k
    if block_q % m or block_k % m or head_dim <= 0 or value_dim <= 0:
        return None
    if head_dim % k or value_dim % k or max(head_dim, value_dim) > 64:
        return None
    return _fitted(MmaBackwardPlan(block_q, block_k, head_dim, value_dim, choice, *TF32_KEYS_ROWS))


def _fitted(plan: MmaBackwardPlan) -> MmaBackwardPlan | None:
    """``plan`` with its keys and rows halved until they divide the IR's blocks and every warp takes
    the same number of dQ fragments (the products need the whole block under the simulator's
    emulation, and a whole warp on the GPU); None where that leaves under 16 of either, or the
    tiles past the shared-memory budget."""
    keys, rows = plan.keys, plan.rows
    while plan.block_k % keys:
        keys //= 2
    while plan.block_q % rows:
        rows //= 2
    m = plan.atom.m
    if keys < m or rows < m:
        return None
    plan = replace(plan, keys=keys, rows=rows)
    while plan.keys > m and plan.dq_tiles % plan.warps:
        plan = replace(plan, keys=plan.keys // 2)
    return plan if plan.fits else None
