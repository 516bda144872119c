"""Which kernel runs an attention: one value, :class:`KernelChoice`, made by :func:`choose`.

An ``ac.tile_grid`` (the forward) or ``ac.key_grid`` (the backward) runs one of several kernels:
the scalar FMA kernels (``kernel.py``, ``backward_kernel.py``, ``deterministic_backward.py`` with
its dQ pass), or products on tensor cores (``mma_kernel.py``, ``mma_f32_kernel.py``,
``mma_backward_kernel.py``, ``mma_tf32_backward_kernel.py``) on one of the atoms of
``mma_atoms.ATOMS``.  :func:`choose` decides which from the grid's IR and the call's types (the
element type of query, key, value and output gradient, the grid's ``precision`` and
``deterministic``), once per grid; the plans and writers read the choice's fields.  Where the plan
for a call's head dims (or rows) does not fit the tensor cores, the scalar kernel runs it
(:meth:`KernelChoice.scalar`).  Each generated kernel carries its choice as the first line of its
source (:meth:`KernelChoice.header`), and ``fn.kernels()`` lists it (``KernelInfo.choice``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from attncomp.backends.numba_cuda.mma_atoms import ATOMS, MmaAtom
from attncomp.ir.core import Op
from attncomp.ir.types import accumulation_dtype

#: the kernel families: an attention's forward, its backward (dK, dV, and dQ by atomics or in a
#: pass of its own), and the dQ pass of a deterministic backward
FORWARD, BACKWARD, DQ = "forward", "backward", "dq pass"
#: the 16-bit element types tensor cores multiply (with float32 accumulation)
HALF_ELEMENTS = ("f16", "bf16")
#: how the device holds query, key and value, as :meth:`KernelChoice.describe` names it
STORAGE_NAMES = {"f32": "f32", "f16": "f16", "bits": "bf16 bits"}
#: flash-tiling's ``precision`` of float32 tile products -> whether they are exact (3xTF32); absent:
#: not on tensor cores ("ieee")
EXACT_BY_PRECISION = {"exact": True, "tf32": False}


@dataclass(frozen=True)
class KernelChoice:
    """The kernel of one attention grid.

    ``family``: :data:`FORWARD`, :data:`BACKWARD` or :data:`DQ`.  ``atom``: the tensor-core
    instruction of the products (``mma_atoms``), None for the scalar FMA kernels; ``operands`` its
    operand type ("f16", "bf16" or "tf32"), and for "tf32" ``exact``: each float32 operand split into
    two tf32 parts and three products made (3xTF32, ``precision = "exact"``), else one product
    (``precision = "tf32"``).  ``storage``: how the device holds query, key and value ("f32"; "f16";
    "bits": bf16 as its 16-bit patterns); ``accumulate``: the accumulation type; ``deterministic``:
    sums in a fixed order with no floating-point atomics (a backward grid's ``deterministic``)."""

    family: str
    atom: MmaAtom | None = None
    operands: str | None = None
    exact: bool = False
    storage: str = "f32"
    accumulate: str = "f32"
    deterministic: bool = False
    #: keys and values staged by 16-byte asynchronous copies into swizzled shared tiles and read by
    #: ``ldmatrix`` (``mma_flash_kernel.py``): 16-bit operands whose key and value rows are dense
    #: (``runtime.dense_rows``); else staged by loads and stores of 32-bit words
    async_copies: bool = False

    @property
    def mma(self) -> bool:
        """Products on tensor cores."""
        return self.atom is not None

    @property
    def tf32(self) -> bool:
        """float32 operands on tf32 products (one, or three of split operands)."""
        return self.operands == "tf32"

    @property
    def products(self) -> str | None:
        """The products' kind as the kernels' comments name it: "f16", "bf16", "tf32", "3xtf32"; None
        for the scalar kernels."""
        return "3xtf32" if self.tf32 and self.exact else self.operands

    def scalar(self) -> KernelChoice:
        """The same grid on the scalar FMA kernels (where its head dims do not fit the tensor cores)."""
        return replace(self, atom=None, operands=None, exact=False, async_copies=False)

    def dq(self) -> KernelChoice:
        """A deterministic backward's dQ pass."""
        return replace(self, family=DQ)

    def describe(self) -> str:
        """One line: family, arithmetic, storage, accumulation, deterministic or atomic."""
        arithmetic = f"mma {self.atom.shape} {self.products}" if self.atom is not None else "fma"
        storage = STORAGE_NAMES.get(self.storage, self.storage)
        order = "deterministic" if self.deterministic else "atomic"
        copies = ", async copies" if self.async_copies else ""
        return f"{self.family}, {arithmetic}{copies}, storage {storage}, accumulate {self.accumulate}, {order}"

    def header(self) -> str:
        """The comment line a generated kernel's source starts with."""
        return f"# kernel: {self.describe()}"


class OnTensorCores:
    """What a tensor-core plan reads of its ``choice`` (a plan holds one, a ``KernelChoice`` with an
    atom): the instruction, the products' kind and the storage."""

    choice: KernelChoice

    @property
    def atom(self) -> MmaAtom:
        """The instruction of the products (``mma_atoms``)."""
        assert self.choice.atom is not None
        return self.choice.atom

    @property
    def element(self) -> str:
        """The products' kind: "f16", "bf16", "tf32" or "3xtf32" (``KernelChoice.products``)."""
        return str(self.choice.products)

    @property
    def storage(self) -> str:
        return self.choice.storage


def kernel_line(choice: KernelChoice | None) -> list[str]:
    """The line a generated kernel module starts with: its choice (none where none is given)."""
    return [] if choice is None else [choice.header()]


def choose(op: Op, storage: str | None = None, fixed_lanes: bool = False) -> KernelChoice:
    """The kernel ``op`` (an ``ac.tile_grid`` or ``ac.key_grid`` of the pipeline's final IR, before
    ``widen-bf16``) asks for, by the types of its query, key and value (and output gradient).

    Tensor cores where these are one type: f16 or bf16 on ``m16n8k16``; float32 on ``m16n8k8`` in
    tf32, exact (3xTF32) or not by the grid's ``precision`` ("ieee": the scalar kernels).  The
    scalar kernels where the types differ, where ``fixed_lanes`` (a layout of the scalar kernels
    asked for: float32 forwards and every backward), and for a ``deterministic`` backward.
    ``storage`` is how the device holds the operands ("bits" where the module keeps bf16 arguments
    16-bit, ``tensor_core_types``); by default "f16" for f16 and "f32" otherwise."""
    from attncomp.backends.backward_tiles import read_tiled_backward
    from attncomp.backends.tiles import read_tiled_attention

    if op.name == "ac.tile_grid":
        family, deterministic = FORWARD, False
        t = read_tiled_attention(op)
        loads = (t.q_load, t.masked.k_load, t.masked.v_load)
    elif op.name == "ac.key_grid":
        family, deterministic = BACKWARD, bool(op.attrs.get("deterministic", False))
        t = read_tiled_backward(op)
        loads = (t.masked.q_load, t.k_load, t.v_load, t.masked.d_out_load)
    else:
        raise ValueError(f"no attention kernel for {op.name}")
    types = {load.operands[0].type.dtype for load in loads}
    element = types.pop() if len(types) == 1 else None
    operands, exact = None, False
    if element in HALF_ELEMENTS:
        operands = element
    elif element == "f32" and not (fixed_lanes and family == FORWARD):
        # float32 on tf32 tensor cores: three products of split operands unless opted into one
        exact = EXACT_BY_PRECISION.get(op.attrs.get("precision", "exact"))
        operands = None if exact is None else "tf32"
        exact = bool(exact)
    if storage is None:
        storage = "f16" if operands == "f16" else "f32"
    choice = KernelChoice(
        family,
        ATOMS[operands] if operands is not None else None,
        operands,
        exact,
        storage,
        accumulation_dtype(op.results[0].type.dtype),
        deterministic,
    )
    if family == BACKWARD and (deterministic or fixed_lanes):
        return choice.scalar()  # the tensor-core backward adds dQ with atomics; lanes are the scalar kernel's
    return choice
