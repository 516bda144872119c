"""How a tensor-core kernel makes its operands from float values: the writers' operand policy.

A kernel on tensor cores (``KernelChoice.atom``) multiplies one of two kinds of operand, and the
forward and backward writers (``mma/forward_kernel.py``, ``mma/backward_kernel.py``) ask an
:class:`Operands`, made from the choice, how:

- **16-bit** (f16, bf16 on ``m16n8k16``): two elements packed into each 32-bit register
  (``pack_f16x2``, ``pack_bf16x2``; ``pack_halves`` and ``pack_bits`` where the device already holds
  16-bit values); one product.  Shared tiles hold words of two elements, and an atom's B fragment
  reads two neighbouring ``k`` in one word: a tile whose product sums along its rows (the forward's
  values, the backward's query and output-gradient rows and keys for dQ) is kept transposed.
- **float32** (``m16n8k8`` in tf32): one element a register, rounded to tf32 (``tf32_round``), tiles
  of whole float32 words, row by row (an ``m16n8k8`` fragment reads a row's neighbouring words, or a
  column's, as cheaply).  ``split`` (3xTF32, flash-tiling's ``precision = "exact"``): also the part
  rounding missed (``tf32_rest``), and each product three, ``rest big + big rest + big big`` (the
  small terms first, so they are not lost in the large): ``big + rest`` holds 22 of float32's 24
  significant bits and the dropped ``rest rest`` is below float32's rounding.  One product
  (``precision = "tf32"``) keeps 11 bits, relative errors near 1e-3 as TF32 matmuls have.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from attncomp.backends.numba_cuda.choice import KernelChoice
from attncomp.backends.numba_cuda.device_math import IMPORT
from attncomp.backends.numba_cuda.mma.atoms import MmaAtom
from attncomp.backends.numba_cuda.warp import IMPORT as WARP_IMPORT

#: how a loaded pair of 16-bit elements becomes one register, by how the device holds them
#: (``KernelChoice.storage``); float32 values are packed by the operand type's own ``pack_*x2``
PACK_LOADED = {"f16": "pack_halves", "bits": "pack_bits"}
#: an element past the keys, as the device holds it
ZERO_LOADED = {"f16": "np.float16(0.0)", "bits": "np.uint16(0)"}


@dataclass(frozen=True)
class Operands:
    """The operands of one tensor-core kernel: ``kind`` ("f16", "bf16" or "tf32") on ``atom``,
    ``split`` into two tf32 parts with three products (3xTF32), read from ``storage`` ("f16",
    "bits": bf16 patterns, "f32": float32 or bf16 widened)."""

    kind: str
    atom: MmaAtom
    split: bool = False
    storage: str = "f32"

    @classmethod
    def of(cls, choice: KernelChoice) -> Operands:
        """The operands of a choice on tensor cores."""
        if choice.atom is None or choice.operands is None:
            raise ValueError(f"not a tensor-core kernel: {choice.describe()}")
        return cls(choice.operands, choice.atom, choice.tf32 and choice.exact, choice.storage)

    @property
    def packed(self) -> bool:
        """Two 16-bit elements a register (and a shared word); else one float32."""
        return self.atom.a.per_register > 1

    @property
    def mma(self) -> str:
        """The device function of one product (``warp.py``)."""
        return f"mma_{self.kind}"

    @property
    def pack(self) -> str:
        """Two float32 values -> one 16-bit register pair."""
        return f"pack_{self.kind}x2"

    @property
    def pack_loaded(self) -> str:
        """Two loaded elements -> one register pair."""
        return PACK_LOADED.get(self.storage, self.pack)

    @property
    def zero(self) -> str:
        """A loaded element past the keys."""
        return ZERO_LOADED.get(self.storage, "ACC(0.0)")

    @property
    def element(self) -> str:
        """The element type as the kernel's header names it: "f16", "bf16" or "float32"."""
        return self.kind if self.packed else "float32"

    def describe(self) -> str:
        """What the kernel's header says of its products, after the element type."""
        if self.packed:
            return f"products on mma.sync.{self.atom.shape}"
        kind = "3xTF32 (split operands, three products)" if self.split else "TF32 (one product)"
        return f"operands as {kind} on mma.sync.{self.atom.shape}"

    def header(self, template: str, func_name: str, plan: object) -> str:
        """A tensor-core kernel's header: ``template`` filled with the function's name, the ``plan``
        (``p``), the element type and products, and the device math and warp imports."""
        return template.format(
            func=func_name,
            p=plan,
            element=self.element,
            products=self.describe(),
            device_math=IMPORT,
            warp=WARP_IMPORT,
        )

    def products(
        self,
        out: str,
        a: Sequence[str],
        b: Sequence[str],
        acc: str,
        a_rest: Sequence[str] = (),
        b_rest: Sequence[str] = (),
    ) -> list[str]:
        """The lines of ``out = A B + acc``: one product, or (split) three of the parts, the small
        terms first, each adding into the last."""
        terms = [(a, b)]
        if self.split:
            terms = [(a_rest, b), (a, b_rest), (a, b)]
        lines = []
        for a_regs, b_regs in terms:
            lines.append(f"{out} = {self.mma}({', '.join(a_regs)}, {', '.join(b_regs)}, {acc})")
            acc = out
        return lines

    def rounded(self, target: str, rest: str, value: str) -> list[str]:
        """The lines of ``target = tf32_round(value)`` and, split, ``rest``: what rounding missed."""
        lines = [f"x_f = ACC({value})", f"{target} = tf32_round(x_f)"]
        if self.split:
            lines.append(f"{rest} = tf32_rest(x_f, {target})")
        return lines

    def fed(self, target: str, rest: str, values: Sequence[str]) -> list[str]:
        """The lines of one A register fed from accumulator values (``MmaAtom.feed``): a pair packed,
        or one float32 rounded (and its rest)."""
        if self.packed:
            return [f"{target} = {self.pack}({', '.join(values)})"]
        (value,) = values
        return self.rounded(target, rest, value)

    def stored(self, value: str) -> str:
        """A float32 as a shared word the backward reads its operands from: rounded to tf32, or
        (split) whole, its two parts taken as each product reads it (``from_word``)."""
        return f"f32_bits({value})" if self.split else f"tf32_round({value})"

    def from_word(self, name: str, word: str) -> list[str]:
        """The lines of operand register ``name`` from a shared word (``stored``); split: ``name`` and
        ``name_r``, the tf32 part and the rest."""
        if not self.split:
            return [f"{name} = {word}"]
        return self.rounded(name, f"{name}_r", f"bits_f32({word})")
