"""The tensor-core backward at FlashAttention-2's design: asynchronous copies, ldmatrix, no transposes.

The tile loop, the elements (``mma/backward_elements.py``) and the stores are the staged backward's
(``mma/backward_kernel.py``); what changes is how operands reach the products.  Where a call's
query, key, value and output-gradient rows are dense (``arrays.dense_rows``), each thread issues a
fixed number of 16-byte ``cp.async`` copies, from one 32-bit offset into its (batch, head) slice
plus constants, zero-filled past the last key or row: the block's keys and values once, each chunk's
query and output-gradient rows (rows a 16-byte multiple apart, ``arrays.pitched_rows``: FlashAttention's
layout read through transposed views, each copy's offset stepping by its source's pitch,
``FlashBackwardWriter.pitched``).  The tiles keep the arrays' rows (``mma/flash_backward_plan.py``),
and every operand is read by ``ldmatrix.x4``, transposed by the instruction where a product sums
along a tile's rows:

    S^T = K Q^T     A: k rows (ldmatrix)                B: q rows (ldmatrix)
    dP^T = V dO^T   A: v rows (ldmatrix)                B: o rows (ldmatrix)
    dV += P^T dO    A: P^T, the C fragments of S^T      B: o (ldmatrix.trans)
                       (split: p, as stored, ldmatrix)
    dK += dS^T Q    A: dS^T, the C fragments            B: q (ldmatrix.trans)
                       (split: ds, as stored, ldmatrix)
    dQ = dS K       A: ds, dS^T as stored (.trans)      B: k (ldmatrix.trans)

A lane gives ``ldmatrix`` one row address per matrix in one of two patterns
(:data:`LANE_PATTERNS`): "a", matrix ``j`` rows ``8 (j % 2)`` and chunk ``j // 2``, the places of an A
fragment, or of the B fragments of two 8-column tiles read transposed; "b", rows ``8 (j // 2)`` and
chunk ``j % 2``, the B fragments of two 8-row tiles read as stored, or an A fragment transposed.  So
a lane keeps one address register per pattern and tile pitch, and every fragment is that plus a
constant.  P and dS are packed to 16 bits once: the same words are the A fragments of dV and dK
and, stored keys by rows, dQ's.  Each key's dK and dV belong to one thread block, and no product is
made twice: up to D = 64 a warp owns its 16 keys' whole columns; past it (a ``split`` of two) two
warps share each 16 keys, each computing half the chunk's rows of ``S^T`` and ``dP^T`` and then half
the dK and dV columns from the ``P^T`` and ``dS^T`` every warp left in shared memory.  dQ is added
with float32 atomics (``red.global.add``), each warp some 16-row tiles' columns
(``FlashBackwardPlan.dq_groups``), as dK and dV are at the end (the outputs are zeroed).
Under Numba's CUDA simulator the copies and ldmatrix run ``mma/warp_sim_copies.py``'s emulation,
which lands a copy only at its wait and counts bank conflicts.
"""

from __future__ import annotations

from attncomp.backends.backward_tiles import BackwardTile
from attncomp.backends.codegen import ScalarEmitter
from attncomp.backends.numba_cuda.lanes import quotient, remainder
from attncomp.backends.numba_cuda.mma.atoms import LDMATRIX_X4, M16N8K16, plus
from attncomp.backends.numba_cuda.mma.backward_kernel import MmaBackwardKernelWriter
from attncomp.backends.numba_cuda.mma.flash_backward_plan import COPY_GROUP, FlashBackwardPlan
from attncomp.backends.numba_cuda.mma.forward_plan import CHUNK_BYTES, COPY_ELEMENTS, row_pitch
from attncomp.ir.core import Op

#: a lane's ldmatrix row, by pattern, from its matrix ``j`` and row ``r`` in it: (rows, chunk) as
#: expressions of ``lm_j`` and ``lm_r`` (see the module)
LANE_PATTERNS = {
    "a": ("((lm_j & 1) << 3) + lm_r", "(lm_j >> 1)"),
    "b": ("((lm_j >> 1) << 3) + lm_r", "(lm_j & 1)"),
}
# the "a" pattern is the A fragment's places (matrix j: rows 8 (j % 2), columns 8 (j // 2))
assert M16N8K16.a.offsets == tuple((j % 2 * 8, j // 2 * COPY_ELEMENTS) for j in range(4))
# and two k halves make a B fragment (b0: k rows 0 .. 7, b1: 8 .. 15)
assert M16N8K16.b.offsets == ((0, 0), (8, 0))

#: 8-column fragments of dQ a warp accumulates at once
DQ_TILES = 4
FA = "fa_0, fa_1, fa_2, fa_3"
FB = "fb_0, fb_1, fb_2, fb_3"


class FlashBackwardWriter(MmaBackwardKernelWriter):
    """Writes the asynchronous-copy tensor-core backward of one ``ac.key_grid`` (see the module)."""

    mp: FlashBackwardPlan
    POSITIONS = "np.int32"  # a sequence is shorter than 2^31

    BLOCK_INDEX = "np.uint32"  # a grid's blocks and a batch's axes are fewer than 2^32
    ROW_TYPE = "np.int32"  # a tile's rows, as its positions: one register each
    #: rows any 16-byte multiple apart (``arrays.pitched_rows``: FlashAttention's ``[B, T, H, D]`` read as
    #: ``[B, H, T, D]``): each copy's offset steps by its source's pitch, read once where the source is
    #: sliced, where consecutive rows step by D or E, a constant of the instruction
    pitched = False

    def scalar(self, integers: str | None = None) -> ScalarEmitter:
        """The IR's integer ops in 32 bits (a sequence is shorter than 2^31): one register and one
        compare each, not two."""
        return super().scalar(integers or self.POSITIONS)

    # shared memory and lanes --------------------------------------------------------
    def lane_terms(self) -> None:
        """As the staged kernel's; with a split, each warp's key group (``w16``), and its part: the
        first of its rows (``wr``) and of its dK and dV columns (``wcd``, ``wce``)."""
        super().lane_terms()
        p, w = self.mp, self.w
        if p.split > 1:
            w.line(f"part = {quotient('warp', p.key_warps)}")
            w.line(f"w16 = {remainder('warp', p.key_warps)} * {M16N8K16.m}")
            w.line(f"wr = part * {p.warp_rows}")
            w.line(f"wcd = part * {p.d_share}")
            w.line(f"wce = part * {p.e_share}")
            self.ROW_BASE = "wr + "

    def shared_arrays(self) -> None:
        """The tiles (``FlashBackwardPlan.tile_bytes``), each lane's ldmatrix addresses, copy places."""
        p, w = self.mp, self.w
        w.line(f"sh = cuda.shared.array({p.words}, np.uint32, alignment=COPY_ALIGNMENT)  # {p.tile_at}")
        self.row_sum_arrays()
        w.line(f"lm_j = {quotient('lane', LDMATRIX_X4.rows)}  # the matrix whose row this lane addresses")
        w.line(f"lm_r = {remainder('lane', LDMATRIX_X4.rows)}")
        for pattern, (rows, chunk) in LANE_PATTERNS.items():
            for dim, pitch in (("d", p.k_pitch), ("e", p.v_pitch), ("r", p.ds_pitch)):
                w.line(f"{pattern}_{dim} = ({rows}) * {pitch} + {chunk} * {CHUNK_BYTES}")
        w.line(f"kw_a = a_d + w16 * {p.k_pitch}  # the warp's keys")
        w.line(f"vw_a = a_e + w16 * {p.v_pitch}")
        # this lane's first word of dS^T (and P^T) in its tile: every store a constant offset from it
        first = f"(w16 + g) * {p.ds_pitch // 4} + tq"
        if p.split > 1:
            first += " + (wr >> 1)"  # two rows a word
            w.line(f"b_dw = b_d + wr * {p.k_pitch}")
            w.line(f"b_ew = b_e + wr * {p.v_pitch}")
            w.line(f"pk_a = a_r + w16 * {p.ds_pitch}  # A of dV and dK: the warp's keys of P^T, dS^T")
            w.line("a_dw = a_d + wcd * 2")
            w.line("a_ew = a_e + wce * 2")
        w.line(f"words = {first}")
        if p.dq_groups > 1:
            w.line(f"dq_row = {remainder('warp', p.m_tiles)} * {M16N8K16.m}")
            w.line(f"dq_col = {quotient('warp', p.m_tiles)} * {p.dq_columns}")
        else:
            w.line(f"dq_row = warp * {M16N8K16.m}")
            w.line("dq_col = 0")
        batch = ", ".join(self.batch)
        w.line(f"dq_rows = out_dq[{batch}]  # this block's (batch, head) rows of dQ" if batch else "dq_rows = out_dq")
        w.line("dq_a = b_r + dq_row * 2")
        w.line("dq_b = a_d + dq_col * 2")
        w.line(f"c_lane = {remainder('tid', COPY_GROUP)}")
        w.line(f"c_group = {quotient('tid', COPY_GROUP)}")
        for dim, elements, pitch in (("d", p.head_dim, p.k_pitch), ("e", p.value_dim, p.v_pitch)):
            per_row = elements // COPY_ELEMENTS  # a thread's first copy (``FlashBackwardPlan.copy_steps``)
            w.line(f"c_col_{dim} = {remainder('c_group', per_row)}")
            w.line(f"c_row_{dim} = {quotient('c_group', per_row)} * {COPY_GROUP} + c_lane")
            w.line(f"c_dst_{dim} = c_row_{dim} * {pitch} + c_col_{dim} * {CHUNK_BYTES}")

    def copies(self, tile: str, src: str, first: str, count: str, rows: int, dim: str) -> None:
        """A thread's copies of ``rows`` rows from row ``first`` of ``src`` into tile ``tile``, from one
        32-bit offset and constant steps; rows past ``count`` read nothing and are zero-filled."""
        p, w = self.mp, self.w
        elements, pitch = (p.head_dim, p.k_pitch) if dim == "d" else (p.value_dim, p.v_pitch)
        step = f"{src}_pitch" if self.pitched else str(elements)
        if self.pitched:
            w.line(f"{step} = {row_pitch(src)}")
        w.line(f"src_at = np.int32(({first} + c_row_{dim}) * {step} + c_col_{dim} * {COPY_ELEMENTS})")
        w.line(f"past = np.int32({count} - c_row_{dim})")
        for at, chunk in p.copy_steps(rows, elements):
            size = f"select({at} < past, {CHUNK_BYTES}, 0)"
            dst = f"c_dst_{dim}{plus(p.tile_at[tile] + at * pitch + chunk * CHUNK_BYTES)}"
            offset = f"np.int32({at}) * {step}{plus(chunk * COPY_ELEMENTS)}" if self.pitched and at else None
            offset = f" + {offset}" if offset else plus(at * elements + chunk * COPY_ELEMENTS)
            w.line(f"cp_async16(sh, {dst}, {src}, src_at{offset}, {size})")

    def stage_keys(self, first: str) -> None:
        """The block's keys and values, one group of copies (landed by the first chunk's wait)."""
        t, p, w = self.t, self.mp, self.w
        w.line(f"k_rows = {self.slice_of(t.k_load)}")
        w.line(f"v_rows = {self.slice_of(t.v_load)}")
        self.copies("k", "k_rows", first, "nk", p.keys, "d")
        self.copies("v", "v_rows", first, "nk", p.keys, "e")
        w.line("cp_async_commit()")

    def stage_rows(self, tile: BackwardTile) -> None:
        """The ``nr`` query and output-gradient rows from ``i0 + r0``, one group of copies, and their
        log-sum-exp and delta."""
        p, w = self.mp, self.w
        w.line(f"q_rows = {self.slice_of(tile.q_load)}")
        w.line(f"o_rows = {self.slice_of(tile.d_out_load)}")
        self.copies("q", "q_rows", "i0 + r0", "nr", p.rows, "d")
        self.copies("o", "o_rows", "i0 + r0", "nr", p.rows, "e")
        w.line("cp_async_commit()")
        self.stage_row_sums(tile)

    # one chunk ---------------------------------------------------------------------
    def chunk(self, tile: BackwardTile, masked: str | None, hoisted: dict[Op, list[Op]]) -> None:
        """The ``nr`` query rows from ``i0 + r0``: copied, the five products, the elements between."""
        p, w = self.mp, self.w
        w.line("cuda.syncthreads()  # every warp is done with the previous chunk's tiles")
        self.stage_rows(tile)
        w.line("cp_async_wait(0)")
        w.line("cuda.syncthreads()")
        split = p.split > 1
        self.score_products(tile, masked, hoisted)
        if split:  # every warp's P^T and dS^T to shared memory first: dV and dK sum over all the rows
            w.line("# P^T, dS^T -> shared")
            self.store_words("p", "pw")
            self.store_words("ds", "dw")
            w.line("cuda.syncthreads()  # P and dS seen by every warp")
            w.line("# dV += P^T dO, dK += dS^T Q: the warp's keys, its part of the columns")
            self.shared_column_products("dv", "p", "o", "a_ew", p.v_pitch, p.e_share)
            self.shared_column_products("dk", "ds", "q", "a_dw", p.k_pitch, p.d_share)
        else:
            w.line("# dV += P^T dO")
            self.column_products("dv", "o", "a_e", p.v_pitch, p.value_dim, "pw")
            w.line("# dS^T -> shared, dK += dS^T Q" if self.ADDS_DQ else "# dK += dS^T Q")
            if self.ADDS_DQ:
                self.store_words("ds", "dw")
            self.column_products("dk", "q", "a_d", p.k_pitch, p.head_dim, "dw")
            if self.ADDS_DQ:
                w.line("cuda.syncthreads()  # dS seen by every warp")
        if self.ADDS_DQ:
            w.line("# dQ += dS K")
            self.dq_products()

    def score_products(self, tile: BackwardTile, masked: str | None, hoisted: dict[Op, list[Op]]) -> None:
        """``S^T`` and ``dP^T`` of the warp's keys and rows, ``live_rows`` rows at a time, each group's
        elements and packed words (``pw``, ``dw``) after its products."""
        p, w = self.mp, self.w
        b_d, b_e = ("b_dw", "b_ew") if p.split > 1 else ("b_d", "b_e")
        for group in range(p.warp_rows // p.live_rows):
            pairs = range(group * p.live_rows // 16, (group + 1) * p.live_rows // 16)
            w.line(f"# S^T = K Q^T, dP^T = V dO^T, the warp's rows {16 * pairs.start} .. {16 * pairs.stop - 1}")
            self.row_products("s", "k", "kw_a", "q", b_d, p.head_dim, p.k_pitch, pairs)
            self.row_products("ds", "v", "vw_a", "o", b_e, p.value_dim, p.v_pitch, pairs)
            self.elements(tile, masked, hoisted, range(2 * pairs.start, 2 * pairs.stop))

    def row_products(
        self, out: str, a_tile: str, a_lane: str, b_tile: str, b_lane: str, width: int, pitch: int, pairs: range
    ) -> None:
        """``out^T = A B^T`` over ``width`` features: A the warp's 16 keys, B the chunk's rows of the
        16-row ``pairs``, both as stored; ``out_{n}_{e}``, one fragment per 8 rows."""
        p, w, atom = self.mp, self.w, self.atom
        for kc in range(width // atom.k):
            w.line(f"{FA} = ldmatrix_x4(sh, {a_lane}{plus(p.tile_at[a_tile] + kc * 2 * CHUNK_BYTES)})")
            for pair in pairs:
                at = p.tile_at[b_tile] + pair * 2 * atom.n * pitch + kc * 2 * CHUNK_BYTES
                w.line(f"{FB} = ldmatrix_x4(sh, {b_lane}{plus(at)})")
                for n, b in ((2 * pair, "fb_0, fb_1"), (2 * pair + 1, "fb_2, fb_3")):
                    fragment = ", ".join(f"{out}_{n}_{e}" for e in range(atom.c.registers))
                    acc = fragment if kc else "ZERO, ZERO, ZERO, ZERO"
                    w.line(f"{fragment} = {self.operands.mma}({FA}, {b}, {acc})")

    def element_done(self, n: int, e: int) -> None:
        """Once a row's pair of elements is done, P and dS of that pair packed into the 16-bit words
        the products read (``pw_{n}_{row}``, ``dw_{n}_{row}``): the float32 values end there."""
        c = self.atom.c
        for row, (e0, e1) in c.by_row():
            if e == e1:
                for word, values in (("pw", "s"), ("dw", "ds")):
                    pair = f"{values}_{n}_{e0}, {values}_{n}_{e1}"
                    self.w.line(f"{word}_{n}_{row} = {self.operands.pack}({pair})")

    def fed(self, words: str, kk: int) -> list[str]:
        """The A fragment of k step ``kk`` (16 rows) from the packed words ``{words}_{n}_{row}``
        (``MmaAtom.feed``: the C fragments of two 8-row tiles, place for place)."""
        atom, c = self.atom, self.atom.c
        found = []
        for halves in atom.feed():
            (tile, e0), (_, e1) = halves
            assert c.offsets[e1] == (c.offsets[e0][0], c.offsets[e0][1] + 1)  # one row's neighbours
            found.append(f"{words}_{atom.tiles * kk + tile}_{c.offsets[e0][0]}")
        return found

    def column_products(self, out: str, tile: str, lane: str, pitch: int, width: int, words: str) -> None:
        """``out += A B``: A the packed ``words`` (keys by rows, :meth:`fed`), B ``width`` features of
        the chunk's rows of ``tile``, read transposed."""
        p, w, atom = self.mp, self.w, self.atom
        for pair in range(width // (2 * atom.n)):
            for kk in range(p.rows // atom.k):
                at = p.tile_at[tile] + kk * atom.k * pitch + pair * 2 * CHUNK_BYTES
                w.line(f"{FB} = ldmatrix_x4_trans(sh, {lane}{plus(at)})")
                a = ", ".join(self.fed(words, kk))
                for n, b in ((2 * pair, "fb_0, fb_1"), (2 * pair + 1, "fb_2, fb_3")):
                    acc = ", ".join(f"{out}_{n}_{e}" for e in range(atom.c.registers))
                    w.line(f"{acc} = {self.operands.mma}({a}, {b}, {acc})")

    def store_words(self, tile: str, words: str) -> None:
        """P^T or dS^T into ``tile[key][row]``: the packed ``words`` as they are (each two rows of
        one key), the warp's rows."""
        p, w, c = self.mp, self.w, self.atom.c
        pitch = p.ds_pitch // 4
        for n in range(p.warp_rows // c.cols):
            for row, _ in c.by_row():
                at = p.tile_at[tile] // 4 + row * pitch + n * c.cols // 2
                w.line(f"sh[U(words + {at})] = {words}_{n}_{row}")

    def shared_column_products(self, out: str, a_tile: str, b_tile: str, lane: str, pitch: int, width: int) -> None:
        """``out += A B`` over the chunk's rows: A the warp's 16 keys of ``a_tile`` (P^T or dS^T, every
        warp's rows) by ldmatrix, B ``width`` features of ``b_tile`` from ``lane``, read transposed."""
        p, w, atom = self.mp, self.w, self.atom
        for kk in range(p.rows // atom.k):
            w.line(f"{FA} = ldmatrix_x4(sh, pk_a{plus(p.tile_at[a_tile] + kk * 2 * CHUNK_BYTES)})")
            for pair in range(width // (2 * atom.n)):
                at = p.tile_at[b_tile] + kk * atom.k * pitch + pair * 2 * CHUNK_BYTES
                w.line(f"{FB} = ldmatrix_x4_trans(sh, {lane}{plus(at)})")
                for n, b in ((2 * pair, "fb_0, fb_1"), (2 * pair + 1, "fb_2, fb_3")):
                    acc = ", ".join(f"{out}_{n}_{e}" for e in range(atom.c.registers))
                    w.line(f"{acc} = {self.operands.mma}({FA}, {b}, {acc})")

    def dq_products(self) -> None:
        """dQ rows += dS K over the block's keys: each warp its 16-row tiles' ``dq_columns``, at most
        ``DQ_TILES`` 8-column fragments at a time (their accumulators live beside dK and dV), the
        products unrolled, then float32 atomics from a slice at the lane's first column."""
        p, w, atom, c = self.mp, self.w, self.atom, self.atom.c
        tiles = p.dq_columns // atom.n
        for i in range(p.dq_row_tiles):
            rows = i * p.warps * atom.m
            for first in range(0, tiles, DQ_TILES):
                columns = range(first, min(first + DQ_TILES, tiles))
                self.dq_pass(rows, columns)
                for offset, registers in c.by_row():
                    # rows past the tile's have dS = 0, so their dQ is +0: added to the last row, not
                    # branched around (no divergent code around the atomics)
                    w.line(f"row = min(r0 + dq_row + {c.row_term}{plus(rows + offset)}, nq - 1)")
                    w.line(f"at = np.int32((i0 + row) * {p.head_dim} + dq_col + {c.col_term})")
                    for n in columns:
                        for e in registers:
                            w.line(f"red_add_f32(dq_rows, at + {n * atom.n + c.offsets[e][1]}, dq_{n}_{e})")

    def dq_pass(self, rows: int, columns: range, name: str = "dq", add: bool = False) -> None:
        """``{name}_{n}_{e}`` of the 8-column fragments ``columns`` of the warp's 16 rows from ``rows``
        (``add``: added to their values, else made)."""
        p, w, atom, c = self.mp, self.w, self.atom, self.atom.c
        for kk in range(p.keys // atom.k):
            at = p.tile_at["ds"] + kk * atom.k * p.ds_pitch + rows * 2
            w.line(f"{FA} = ldmatrix_x4_trans(sh, dq_a{plus(at)})")
            for pair in range(columns.start // 2, columns.stop // 2):
                at = p.tile_at["k"] + kk * atom.k * p.k_pitch + pair * 2 * CHUNK_BYTES
                w.line(f"{FB} = ldmatrix_x4_trans(sh, dq_b{plus(at)})")
                for n, b in ((2 * pair, "fb_0, fb_1"), (2 * pair + 1, "fb_2, fb_3")):
                    fragment = ", ".join(f"{name}_{n}_{e}" for e in range(c.registers))
                    acc = fragment if kk or add else "ZERO, ZERO, ZERO, ZERO"
                    w.line(f"{fragment} = {self.operands.mma}({FA}, {b}, {acc})")

    def store(self) -> None:
        """dK and dV into the key/value head's rows by float32 atomics, from a slice at each row's first
        column: the outputs are zeroed, so one block's adds are its stores and several blocks' (grouped
        heads, a broadcast batch axis) their sum, in one code; then the sites' last runs."""
        p, w, c = self.mp, self.w, self.atom.c
        prefix = self.kv_prefix().rstrip(", ")
        shares = (("out_dk", "dk", p.d_share, p.head_dim, "wcd + "), ("out_dv", "dv", p.e_share, p.value_dim, "wce + "))
        for out, acc, *_ in shares:
            w.line(f"{acc}_rows = {out}[{prefix}]" if prefix else f"{acc}_rows = {out}")
        for offset, registers in c.by_row():
            w.line(f"if w16 + {c.row_term} + {offset} < nk:")
            with w.indent():
                w.line(f"key = j0 + koff + w16 + {c.row_term}{plus(offset)}")
                for _out, acc, width, dim, first in shares:
                    first = first if p.split > 1 else ""
                    w.line(f"at = np.int32(key * {dim} + {first}{c.col_term})")
                    for en in range(width // c.cols):
                        for e in registers:
                            at = en * c.cols + c.offsets[e][1]
                            w.line(f"red_add_f32({acc}_rows, at + {at}, {acc}_{en}_{e})")
        for k in range(len(self.sites)):
            self.site_flush(k)

    def tile_loop(self, hoisted: dict[Op, list[Op]]) -> None:
        """The loop over query blocks, then the stores (after the keys' copies, where no chunk ran)."""
        self.query_loop(hoisted)
        self.w.line("cp_async_wait(0)")
        self.store()
