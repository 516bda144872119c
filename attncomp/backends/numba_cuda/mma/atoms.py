"""The tensor-core instructions the kernels use, as data ("MMA atoms", as CuTe and Triton describe them).

Each :class:`MmaAtom` is one ``mma.sync.aligned`` shape: ``m16n8k16`` with f16 or bf16 elements
(:data:`M16N8K16`) and ``m16n8k8`` with tf32 elements (:data:`M16N8K8_TF32`), both with float32
accumulation (``D = A B + C``, A ``m x k``, B ``k x n``, C and D ``m x n``).  For each operand a
:class:`Fragment` says which element of the matrix each lane's registers hold (PTX ISA, "Matrix
Fragments for mma.m16n8k16" and "... for mma.m16n8k8"): for lane ``l``, ``g = l // 4`` (its group)
and ``t = l % 4`` (its place in the quad), register ``r`` and, where a register holds two 16-bit
elements, its half ``h`` (0: the low 16 bits, 1: the high), the element is

    row = row_lane[0] g + row_lane[1] t + offsets[r][0] + h high[0]
    col = col_lane[0] g + col_lane[1] t + offsets[r][1] + h high[1]

so the low half holds the lower column of an A register and the lower row of a B register.  This
table is the one statement of the layouts: ``mma/warp_sim.py``'s emulation places the registers by it,
and the kernel writers (``mma/forward_kernel.py``, ``mma/backward_kernel.py``, with the operands of
``mma/operands.py``) and plans take their fragment places, steps and orders from it;
``tests/cuda_sim`` check it against numpy's products, on the GPU against the PTX.

What the writers derive from an atom: its k step (:attr:`MmaAtom.k`); the A and B places as 32-bit
words (:attr:`MmaAtom.a_words`, :attr:`MmaAtom.b_words`, :attr:`MmaAtom.step_words`); the C
registers of each of a lane's two rows and the columns it holds (:meth:`Fragment.by_row`,
:meth:`Fragment.columns`); and how accumulator fragments feed the A fragment of the next product
(:meth:`MmaAtom.feed`, :meth:`MmaAtom.fed_b_rows`).  The product sums over its ``k``, so A's
columns may come in another order than C's as long as B's rows come in the same one: in m16n8k16
the C fragments of two 8-column tiles are, place for place, the A fragment of their 16 columns; in
m16n8k8 a lane's C columns ``2t, 2t + 1`` are fed as ``k = t, t + 4`` (:meth:`MmaAtom.k_order`).
"""

from __future__ import annotations

from dataclasses import dataclass

#: lanes in a warp
LANES = 32
#: the bit at which each half of a 32-bit register starts: half 0 is the low 16 bits
HALF_SHIFTS = (0, 16)
#: the names a generated kernel gives a lane's terms, by (g, t) coefficients: ``g``, ``tq``, ``2 tq``
LANE_TERMS = {(1, 0): "g", (0, 1): "tq", (0, 2): "t2"}


def lane_parts(lane: int) -> tuple[int, int]:
    """(g, t) of a lane: its group of four and its place in the group."""
    return lane // 4, lane % 4


@dataclass(frozen=True)
class Fragment:
    """Which element of a ``rows x cols`` operand each lane's registers hold (see the module)."""

    rows: int
    cols: int
    #: (g, t) coefficients of a lane's first row and first column
    row_lane: tuple[int, int]
    col_lane: tuple[int, int]
    #: per register: (row, column) from the lane's first element
    offsets: tuple[tuple[int, int], ...]
    #: elements per register: 2 (16-bit halves) or 1
    per_register: int = 1
    #: (row, column) from a register's low half to its high half
    high: tuple[int, int] = (0, 0)

    @property
    def registers(self) -> int:
        return len(self.offsets)

    def place(self, lane: int, register: int, half: int = 0) -> tuple[int, int]:
        """(row, column) of a lane's register (and half)."""
        g, t = lane_parts(lane)
        row = self.row_lane[0] * g + self.row_lane[1] * t + self.offsets[register][0] + half * self.high[0]
        col = self.col_lane[0] * g + self.col_lane[1] * t + self.offsets[register][1] + half * self.high[1]
        return row, col

    def first_col(self, lane: int) -> int:
        """A lane's first column."""
        g, t = lane_parts(lane)
        return self.col_lane[0] * g + self.col_lane[1] * t

    def places(self) -> tuple[tuple[tuple[tuple[int, int], ...], ...], ...]:
        """Every place, by lane, register and half."""
        return tuple(
            tuple(tuple(self.place(lane, r, h) for h in range(self.per_register)) for r in range(self.registers))
            for lane in range(LANES)
        )

    @property
    def row_term(self) -> str:
        """A lane's first row as a generated kernel names it."""
        return LANE_TERMS[self.row_lane]

    @property
    def col_term(self) -> str:
        """A lane's first column as a generated kernel names it."""
        return LANE_TERMS[self.col_lane]

    def columns(self) -> tuple[int, ...]:
        """The column offsets a lane holds (of the accumulator: ``2t`` and ``2t + 1`` of each 8)."""
        return tuple(sorted({col for _, col in self.offsets}))

    def by_row(self) -> tuple[tuple[int, tuple[int, ...]], ...]:
        """(row offset, the registers on that row) for each row a lane holds, in register order."""
        rows = sorted({row for row, _ in self.offsets})
        return tuple((row, tuple(r for r, (at, _) in enumerate(self.offsets) if at == row)) for row in rows)

    def row_index(self, register: int) -> int:
        """Which of a lane's rows (in :meth:`by_row`'s order) a register is on."""
        return [row for row, _ in self.by_row()].index(self.offsets[register][0])

    def row_lane_masks(self) -> tuple[int, ...]:
        """The lane bits (as XOR masks) that leave a lane's rows unchanged: the lanes that share a row
        of the fragment are ``lane ^ mask`` for combinations of these (a quad, for the accumulator)."""
        return tuple(1 << b for b in range(5) if self.place(1 << b, 0)[0] == self.place(0, 0)[0])

    def next_row_mask(self) -> int:
        """The XOR mask of the lane bit that moves a lane's rows by one (``g ^ 1``: the neighbouring row)."""
        return next(1 << b for b in range(5) if abs(self.place(1 << b, 0)[0] - self.place(0, 0)[0]) == 1)


@dataclass(frozen=True)
class MmaAtom:
    """One ``mma.sync.aligned.{shape}.row.col.f32.{element}.{element}.f32`` instruction."""

    shape: str
    elements: tuple[str, ...]
    m: int
    n: int
    k: int
    a: Fragment
    b: Fragment
    c: Fragment

    @property
    def a_words(self) -> tuple[tuple[int, int], ...]:
        """Per A register: (row, 32-bit word along k) from the lane's first, in a row of packed words."""
        return tuple((row, col // self.a.per_register) for row, col in self.a.offsets)

    @property
    def b_words(self) -> tuple[int, ...]:
        """Per B register: its 32-bit word along k from the lane's first, in a column of packed words."""
        return tuple(row // self.b.per_register for row, _ in self.b.offsets)

    @property
    def step_words(self) -> int:
        """The 32-bit words one k step spans."""
        return self.k // self.a.per_register

    @property
    def k_half(self) -> int:
        """How far (in k) the A fragment's second column half is from its first."""
        return self.a.columns()[-1]

    @property
    def tiles(self) -> int:
        """Accumulator tiles (n columns each) whose fragments make one A fragment: ``k / n``."""
        return self.k // self.n

    def _fed_column(self, a_col: int) -> tuple[int, int]:
        """(tile, C column offset) that feeds an A column offset: a lane's A columns and its C columns
        over ``tiles`` tiles, matched in order."""
        a_cols = sorted({col + h * self.a.high[1] for _, col in self.a.offsets for h in range(self.a.per_register)})
        c_cols = [(tile, col) for tile in range(self.tiles) for col in self.c.columns()]
        return dict(zip(a_cols, c_cols))[a_col]

    def feed(self) -> tuple[tuple[tuple[int, int], ...], ...]:
        """Per A register, per half: the (tile, C register) whose value it takes, so that the
        accumulators of ``tiles`` products become the A operand of the next without a trade."""
        found = []
        for row, col in self.a.offsets:
            halves = []
            for h in range(self.a.per_register):
                tile, c_col = self._fed_column(col + h * self.a.high[1])
                halves.append((tile, self.c.offsets.index((row + h * self.a.high[0], c_col))))
            found.append(tuple(halves))
        return tuple(found)

    def feed_order(self) -> tuple[int, ...]:
        """The C registers in the order of the A registers (one element each, one tile)."""
        assert self.tiles == 1 and self.a.per_register == 1
        return tuple(halves[0][1] for halves in self.feed())

    def k_order(self) -> tuple[int, ...]:
        """For each k of a product fed from accumulators (:meth:`feed`), the accumulator column it
        takes (over ``tiles`` tiles): a permutation of ``range(k)``, the same for every lane."""
        order: dict[int, int] = {}
        for lane in range(LANES):
            for r, (_, col) in enumerate(self.a.offsets):
                for h in range(self.a.per_register):
                    tile, c_col = self._fed_column(col + h * self.a.high[1])
                    k = self.a.place(lane, r, h)[1]
                    column = tile * self.n + self.c.first_col(lane) + c_col
                    if order.setdefault(k, column) != column:
                        raise ValueError(f"{self.shape}: k = {k} fed from two columns")
        if sorted(order) != list(range(self.k)) or sorted(order.values()) != list(range(self.k)):
            raise ValueError(f"{self.shape}: the fed columns are not a permutation of k")
        return tuple(order[k] for k in range(self.k))

    def fed_b_rows(self) -> tuple[tuple[int, ...], ...]:
        """Per B register, per half: the row of B to read, from the lane's first accumulator column
        (``c.col_term``), when A is fed from accumulators: B's rows in :meth:`k_order`."""
        order = self.k_order()
        found = []
        for r in range(self.b.registers):
            halves = []
            for h in range(self.b.per_register):
                offsets = set()
                for lane in range(LANES):
                    offsets.add(order[self.b.place(lane, r, h)[0]] - self.c.first_col(lane))
                (offset,) = offsets  # the same for every lane
                halves.append(offset)
            found.append(tuple(halves))
        return tuple(found)


#: C and D of both shapes, 16 x 8 float32: ``c0, c1 = C[g, 2t], C[g, 2t + 1]``,
#: ``c2, c3 = C[g + 8, 2t], C[g + 8, 2t + 1]``
ACCUMULATOR = Fragment(16, 8, (1, 0), (0, 2), ((0, 0), (0, 1), (8, 0), (8, 1)))

#: ``mma.sync.aligned.m16n8k16``, f16 or bf16: A 16 x 16 (``a0 = A[g, 2t:2t+2]``, ``a1`` rows + 8,
#: ``a2`` columns + 8, ``a3`` both), B 16 x 8 (``b0 = B[2t:2t+2, g]``, ``b1`` rows + 8), two
#: elements a register, the lower column (A) or row (B) in the low half
M16N8K16 = MmaAtom(
    shape="m16n8k16",
    elements=("f16", "bf16"),
    m=16,
    n=8,
    k=16,
    a=Fragment(16, 16, (1, 0), (0, 2), ((0, 0), (8, 0), (0, 8), (8, 8)), per_register=2, high=(0, 1)),
    b=Fragment(16, 8, (0, 2), (1, 0), ((0, 0), (8, 0)), per_register=2, high=(1, 0)),
    c=ACCUMULATOR,
)

#: ``mma.sync.aligned.m16n8k8``, tf32 (float32 bits, the low 13 ignored): A 16 x 8 (``a0 = A[g, t]``,
#: ``a1 = A[g + 8, t]``, ``a2 = A[g, t + 4]``, ``a3 = A[g + 8, t + 4]``), B 8 x 8 (``b0 = B[t, g]``,
#: ``b1 = B[t + 4, g]``), one element a register
M16N8K8_TF32 = MmaAtom(
    shape="m16n8k8",
    elements=("tf32",),
    m=16,
    n=8,
    k=8,
    a=Fragment(16, 8, (1, 0), (0, 1), ((0, 0), (8, 0), (0, 4), (8, 4))),
    b=Fragment(8, 8, (0, 1), (1, 0), ((0, 0), (4, 0))),
    c=ACCUMULATOR,
)

#: shared memory's banks: 32 of 4 bytes; a warp's access is served in one pass ("wavefront") per set
#: of distinct 4-byte words that share no bank, so two distinct words of one bank in one phase cost
#: a pass more (a bank conflict)
BANKS = 32
BANK_BYTES = 4


@dataclass(frozen=True)
class LdMatrix:
    """``ldmatrix.sync.aligned.m8n8.x{count}{.trans}.shared.b16``: ``count`` 8 x 8 matrices of 16-bit
    elements from shared memory into ``count`` registers of every lane (PTX ISA, "Warp-level matrix
    load instruction: ldmatrix").  Lanes ``8 j .. 8 j + 7`` give the addresses of matrix ``j``'s eight
    rows (16 contiguous bytes each; row ``lane % 8``), and register ``j`` of every lane holds its
    places of matrix ``j`` by :attr:`fragment`: ``(g, 2t)`` and ``(g, 2t + 1)`` (the low half first),
    or with ``.trans`` ``(2t, g)`` and ``(2t + 1, g)``.  Read so, the rows of a row-major tile are B
    fragments of ``m16n8k16`` along ``k`` (``b0, b1`` of :data:`M16N8K16` are matrices ``k`` 0-7 and
    8-15 of one 8-column tile), and ``.trans`` gives them from a tile whose rows are ``k``.  One
    phase a matrix: its eight rows are conflict-free when they fall in eight distinct 16-byte
    quarters of the 128 bytes the banks span."""

    count: int
    trans: bool
    fragment: Fragment
    rows: int = 8
    row_bytes: int = 16

    @property
    def name(self) -> str:
        return f"ldmatrix.sync.aligned.m8n8.x{self.count}{'.trans' if self.trans else ''}.shared.b16"

    def matrix_of(self, lane: int) -> tuple[int, int]:
        """(matrix, row) whose address a lane gives."""
        return divmod(lane, self.rows)


#: ldmatrix's places: a lane holds row ``g``, columns ``2t, 2t + 1``; transposed, rows ``2t, 2t + 1`` of column ``g``
LDMATRIX_X4 = LdMatrix(4, False, Fragment(8, 8, (1, 0), (0, 2), ((0, 0),), per_register=2, high=(0, 1)))
LDMATRIX_X4_TRANS = LdMatrix(4, True, Fragment(8, 8, (0, 2), (1, 0), ((0, 0),), per_register=2, high=(1, 0)))


@dataclass(frozen=True)
class AsyncCopy:
    """``cp.async.cg.shared.global [dst], [src], 16, src_size``: 16 bytes from global memory to shared
    memory, asynchronously, bypassing L1 (PTX ISA, "cp.async").  ``src_size`` bytes are read and the
    rest zero-filled (0: all zeros, the tile's keys past the end).  Copies a thread issues join a
    group at ``cp.async.commit_group``; ``cp.async.wait_group n`` waits until at most ``n`` of the
    thread's groups are in flight, and only then are their bytes in shared memory, seen by other
    threads after a barrier.  A warp's 16-byte stores are served a quarter-warp (8 lanes, 128 bytes)
    a phase."""

    bytes: int = 16
    lanes_per_phase: int = 8

    @property
    def name(self) -> str:
        return f"cp.async.cg.shared.global [dst], [src], {self.bytes}, src_size"


CP_ASYNC_16 = AsyncCopy()

#: the atom of each element type the kernels multiply
ATOMS = {"f16": M16N8K16, "bf16": M16N8K16, "tf32": M16N8K8_TF32, "3xtf32": M16N8K8_TF32}


def plus(offset: int) -> str:
    """`` + offset`` for an expression in a generated kernel, nothing for 0."""
    return f" + {offset}" if offset else ""
