"""Reading ``nvdisasm`` output: functions, instructions, loops, and counts over them.

Pure functions over the disassembly's text.  An instruction line looks like

    /*0a30*/              @!P0 LDG.E.U16 R4, desc[UR4][R2.64] ;

and a label line like ``.L_x_12:``; a function starts at its ``.section .text.NAME`` line and a kernel
(an entry function) is the one declared ``.global``.  ``NOP`` (alignment padding after the last
instruction) is not counted.  A loop is a ``BRA`` to a label at or before it; its body is the
instructions from the label to the branch, both included, so a loop nested in it counts once.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

#: the memory instructions counted by kind and width: global, global-to-shared (cp.async), shared
#: matrix (ldmatrix), shared, local (spills), and generic loads and stores
MEMORY = ("LDG", "LDGSTS", "LDSM", "LDS", "STS", "STG", "LDL", "STL", "LD", "ST")

_SECTION = re.compile(r"^\s*\.section\s+\.text\.([^,\s]+)")
_GLOBAL = re.compile(r"^\s*\.global\s+(\S+)")
_LABEL = re.compile(r"^\s*([.$\w]+):\s*$")
_INSTRUCTION = re.compile(
    r"/\*([0-9a-fA-F]+)\*/\s+(?:(@!?U?P(?:T|\d+))\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)*)\s*([^;]*);"
)
_TARGET = re.compile(r"`\(([^)]+)\)")
_BITS = {"U8": 8, "S8": 8, "U16": 16, "S16": 16, "64": 64, "128": 128}
_MATRICES = re.compile(r"\.MT?88\.(\d)")


@dataclass(frozen=True)
class Instruction:
    address: int
    opcode: str  # the mnemonic with its modifiers: "LDG.E.U16"
    predicate: str = ""  # "@P0", "@!P0", "@!PT" (never executes), or ""
    operands: str = ""

    @property
    def mnemonic(self) -> str:
        return self.opcode.split(".", 1)[0]

    @property
    def never(self) -> bool:
        """Predicated off for good (``@!PT``): issued, never executed."""
        return self.predicate == "@!PT"

    @property
    def target(self) -> str | None:
        """The label a branch goes to."""
        found = _TARGET.search(self.operands)
        return found.group(1) if found else None


@dataclass
class Function:
    name: str
    entry: bool = False  # a kernel (``.global``), not a subroutine it calls
    instructions: list[Instruction] = field(default_factory=list)
    labels: dict[str, int] = field(default_factory=dict)  # label: index of the instruction after it


@dataclass(frozen=True)
class Loop:
    label: str  # the branch's target, the loop's first instruction
    start: int  # index of the first instruction
    end: int  # index of the backward BRA (included)
    instructions: int
    hmma: int


def parse(text: str) -> list[Function]:
    """The functions of a disassembly, in order (kernels and the subroutines they call)."""
    functions: list[Function] = []
    for line in text.splitlines():
        section = _SECTION.match(line)
        if section:
            functions.append(Function(section.group(1)))
            continue
        if not functions:
            continue
        current = functions[-1]
        if _GLOBAL.match(line):
            current.entry = True
        elif label := _LABEL.match(line):
            current.labels[label.group(1)] = len(current.instructions)
        elif found := _INSTRUCTION.search(line):
            address, predicate, opcode, operands = found.groups()
            if opcode != "NOP":
                current.instructions.append(Instruction(int(address, 16), opcode, predicate or "", operands.strip()))
    return functions


def kernels(functions: Iterable[Function]) -> list[Function]:
    """The entry functions."""
    return [f for f in functions if f.entry]


def count(instructions: Iterable[Instruction], mnemonic: str) -> int:
    """How many instructions have this mnemonic (``HMMA``: every shape and type)."""
    return sum(1 for i in instructions if i.mnemonic == mnemonic)


def width(opcode: str) -> int:
    """Bits each thread moves: ``.U16`` 16, ``.64`` 64, ``.128`` 128, none 32; ``LDSM``: 32 per 8x8 matrix."""
    if opcode.startswith("LDSM"):
        matrices = _MATRICES.search(opcode)
        return 32 * int(matrices.group(1)) if matrices else 32
    bits = [_BITS[m] for m in opcode.split(".")[1:] if m in _BITS]
    return bits[-1] if bits else 32


def memory(instructions: Iterable[Instruction]) -> dict[str, int]:
    """Loads and stores by opcode (``LDG.E.U16``: 44, ...), in ``MEMORY``'s order then by name;
    ``@!PT`` ones (placeholders that never execute) left out."""
    found = Counter(i.opcode for i in instructions if i.mnemonic in MEMORY and not i.never)
    order = {m: k for k, m in enumerate(MEMORY)}
    return dict(sorted(found.items(), key=lambda item: (order[item[0].split(".", 1)[0]], width(item[0]), item[0])))


def loops(function: Function) -> list[Loop]:
    """Every backward branch of a function as a loop, in program order of the branches."""
    found = []
    body = function.instructions
    for end, instruction in enumerate(body):
        if instruction.mnemonic != "BRA" or ".DIV" in instruction.opcode:  # BRA.DIV: to a divergent path
            continue
        start = function.labels.get(instruction.target or "")
        if start is None or start > end:
            continue
        found.append(Loop(instruction.target, start, end, end - start + 1, count(body[start : end + 1], "HMMA")))
    return found


def main_loop(function: Function) -> Loop | None:
    """The loop whose iterations run the most ``HMMA``: those of its body outside any loop nested in
    it (a kernel whose run of full tiles has a loop of its own, beside the general body in the loop
    over every tile, has two loops of as many: the run's); of equals, the shortest; None when no
    loop holds any."""
    candidates = [loop for loop in loops(function) if loop.hmma]
    if not candidates:
        return None

    def own(loop: Loop) -> int:
        nested = set()
        for other in candidates:
            if other is not loop and loop.start <= other.start and other.end <= loop.end:
                nested.update(range(other.start, other.end + 1))
        body = function.instructions
        return sum(1 for k in range(loop.start, loop.end + 1) if k not in nested and body[k].mnemonic == "HMMA")

    most = max(own(loop) for loop in candidates)
    return min((loop for loop in candidates if own(loop) == most), key=lambda loop: loop.instructions)


def body(function: Function, loop: Loop) -> list[Instruction]:
    """The instructions of a loop's body."""
    return function.instructions[loop.start : loop.end + 1]
