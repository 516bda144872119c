"""What every kernel plan says the same way: the IR's tiles, and how a thread block's threads follow.

A plan (``simt/forward_plan.py``, ``simt/backward_plan.py``, ``simt/dq_plan.py``,
``mma/forward_plan.py``, ``mma/backward_plan.py``) maps one IR tile of ``block_q`` query rows and
``block_k`` keys, with head dims D and E, onto thread blocks.  Each spreads its threads over one kind
of item, its ``OWNERS``: query rows (the forwards, the dQ pass) or keys (the backwards).  A thread
block holds ``owners`` of them, so an IR block is ``parts`` thread blocks; the scalar kernels give
each item ``lanes`` threads (:class:`LanePlan`: lane ``g`` keeps features ``g, g + lanes, ...``),
the tensor-core kernels a warp to every 16 (:class:`WarpPlan`, the ``m`` of the atom).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, TypeVar

from attncomp.backends.numba_cuda.choice import KernelChoice, OnTensorCores
from attncomp.backends.numba_cuda.lanes import SHARED_BUDGET, WARP, ceil_div
from attncomp.backends.tiles import LoweringError

#: a plan of any kind (what :meth:`BlockPlan.within_budget` hands back)
Plan = TypeVar("Plan", bound="BlockPlan")
#: the IR block each kind of item tiles: query rows tile ``block_q``, keys ``block_k``
IR_BLOCK = {"rows": "block_q", "keys": "block_k"}


@dataclass(frozen=True)
class BlockPlan:
    """The sizes every plan starts from; ``OWNERS`` names the field of the items a thread block
    holds ("rows" or "keys")."""

    block_q: int  # query rows of the IR's tile
    block_k: int  # keys of the IR's tile
    head_dim: int  # D: query/key features
    value_dim: int  # E: value/output features

    OWNERS: ClassVar[str] = "rows"

    @property
    def owners(self) -> int:
        """The items (query rows or keys) a thread block holds."""
        return getattr(self, self.OWNERS)

    @property
    def parts(self) -> int:
        """Thread blocks per IR block of those items."""
        return ceil_div(getattr(self, IR_BLOCK[self.OWNERS]), self.owners)

    @property
    def threads(self) -> int:
        raise NotImplementedError

    @property
    def shared_bytes(self) -> int:
        raise NotImplementedError

    @property
    def fits(self) -> bool:
        """Whether a thread block's shared memory is within the budget (``lanes.SHARED_BUDGET``)."""
        return self.shared_bytes <= SHARED_BUDGET

    def within_budget(self: Plan, kernel: str) -> Plan:
        """This plan, if it fits; else the error that says so (``kernel``: which, as "cuda backward")."""
        if not self.fits:
            raise LoweringError(
                f"{kernel}: head dims D = {self.head_dim}, E = {self.value_dim} need {self.shared_bytes} bytes of "
                f"shared memory per block, over the {SHARED_BUDGET} available"
            )
        return self


@dataclass(frozen=True)
class LanePlan(BlockPlan):
    """A scalar kernel's plan: ``lanes`` consecutive threads per item."""

    lanes: int  # threads per item

    @property
    def threads(self) -> int:
        return self.owners * self.lanes

    # lane ``g`` of an item keeps its features ``g, g + lanes, ...``: a slice of registers
    @property
    def head_slice(self) -> int:
        """Query/key features (of D) per lane: registers of the query, dK or dQ slice."""
        return ceil_div(self.head_dim, self.lanes)

    @property
    def value_slice(self) -> int:
        """Value features (of E) per lane: registers of the output or dV slice."""
        return ceil_div(self.value_dim, self.lanes)

    @property
    def head_pad(self) -> int:
        """D rounded up to whole lane slices (a staged row's features, zero padded)."""
        return self.head_slice * self.lanes

    @property
    def value_pad(self) -> int:
        """E rounded up to whole lane slices."""
        return self.value_slice * self.lanes


@dataclass(frozen=True)
class WarpPlan(OnTensorCores, BlockPlan):
    """A tensor-core kernel's plan: one warp per ``m`` items (the rows of the atom's products)."""

    #: the kernel (``choice.KernelChoice``): its atom and operand type, and how the device holds the
    #: operands ("f16"; "bits": bf16 as its 16-bit patterns; "f32": float32, or bf16 widened)
    choice: KernelChoice

    @property
    def warps(self) -> int:
        return self.owners // self.atom.m

    @property
    def threads(self) -> int:
        return self.warps * WARP
