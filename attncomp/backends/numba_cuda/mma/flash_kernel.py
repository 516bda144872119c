"""The tensor-core forward at FlashAttention-2's design: asynchronous copies, ldmatrix, swizzled tiles.

The products, the scores, the online softmax and the finish are ``mma/forward_kernel.py``'s; what
changes is how keys and values reach the B fragments.  Where a call's query, key and value rows are dense (the
last two axes of each array contiguous, 16-byte aligned: ``arrays.dense_rows``; or each row contiguous,
the rows a 16-byte multiple apart: ``arrays.pitched_rows``, FlashAttention's layout read through a
transposed view, its copies' offsets stepping by the pitch, ``FlashKernelWriter.pitched``) and D and E are
multiples of 64, each thread issues a fixed number of 16-byte ``cp.async`` copies per chunk
(``atoms.CP_ASYNC_16``), with zero fill past the last key, into shared tiles kept row by row as
the arrays are (``k_sh[key, d]``, ``v_sh[key, e]``): no transposed copy.  A row's 16-byte chunk
``c`` is stored at chunk ``c ^ (row % 8)`` (an XOR swizzle), so that the eight rows an ``ldmatrix``
phase reads, and the eight chunks a quarter-warp of copies writes, fall in distinct banks.  The B
fragments come from ``ldmatrix.x4`` (keys) and ``ldmatrix.x4.trans`` (values), four registers an
instruction, from addresses a lane computes once (``shared_arrays``) plus constants.

A paged pool's rows are copied the same way, each copy row from its page (``mma/page_copies.py``);
a decode step of grouped heads packs the group's rows into one tile (``mma/packed_heads.py``).

A warp computes one or two 16-row tiles of queries (``MmaPlan.m_tiles``, by head dim and score
work: ``forward_plan.FLASH_SHAPES``).  With two, the block's query rows arrive by the same copies
into a swizzled ``q_sh`` before the first chunk, each tile's A fragments are read from it by
``ldmatrix.x4`` for each pair of k steps, and every key and value fragment feeds both tiles'
products; with one, the warp keeps its A fragments in registers.  All the row and key positions the
loop carries, and the IR's integer ops (tile classes, bounds, masks), are 32-bit.

The key loop (which chunks, in which order, with which copies in flight) is ``mma/flash_loop.py``'s.

A thread's copies of a whole chunk go from one offset into its (batch, head) slice and one shared
address, plus constants the instructions carry; the offset in 32 bits (a head's keys times
features are fewer than 2^31).  Under Numba's CUDA simulator the copies and ldmatrix
run ``mma/warp_sim_copies.py``'s emulation, which lands a copy only at its wait and counts bank
conflicts (``tests/cuda_sim/test_sim_flash.py`` asserts none).
"""

from __future__ import annotations

from attncomp.backends.codegen import ScalarEmitter
from attncomp.backends.numba_cuda.lanes import quotient, remainder
from attncomp.backends.numba_cuda.mma.atoms import LDMATRIX_X4, M16N8K16
from attncomp.backends.numba_cuda.mma.flash_loop import FlashKeyLoop
from attncomp.backends.numba_cuda.mma.forward_kernel import MmaKernelWriter
from attncomp.backends.numba_cuda.mma.forward_plan import (
    CHUNK_BYTES,
    COPY_ELEMENTS,
    SWIZZLE,
    SWIZZLED,
    row_pitch,
    swizzled,
)
from attncomp.backends.numba_cuda.mma.fragment_rows import ROW_NAMES, row_letter, tile_name
from attncomp.backends.numba_cuda.mma.packed_heads import PackedHeads
from attncomp.backends.numba_cuda.mma.page_copies import PageCopies
from attncomp.backends.tiles import TileCompute
from attncomp.ir.core import Op


class FlashKernelWriter(PackedHeads, PageCopies, FlashKeyLoop, MmaKernelWriter):
    """Writes the asynchronous-copy tensor-core kernel of one tiled attention (see the module)."""

    POSITIONS = "np.int32"  # a sequence is shorter than 2^31
    #: rows any 16-byte multiple apart (``arrays.pitched_rows``: FlashAttention's ``[B, T, H, D]`` read as
    #: ``[B, H, T, D]``, a head's rows ``H * D`` apart): each copy's offset steps by the rows' pitch, read
    #: once a block from the array, where consecutive rows step by D, a constant of the instruction
    pitched = False

    def scalar(self, integers: str | None = None) -> ScalarEmitter:
        """The IR's integer ops in 32 bits, as the loop's positions (tile classes, bounds, a mask's
        positions and ids): one register and one compare each, not two."""
        return super().scalar(integers or self.POSITIONS)

    def shared_arrays(self) -> None:
        """The key and value tiles, and each lane's ldmatrix addresses into them."""
        p, w, atom = self.mp, self.w, self.atom
        # 16-byte aligned (``warp.COPY_ALIGNMENT``): a copy's destination and an ldmatrix row are
        w.line(f"k_sh = cuda.shared.array({p.k_words}, np.uint32, alignment=COPY_ALIGNMENT)")
        w.line(f"v_sh = cuda.shared.array({p.v_words}, np.uint32, alignment=COPY_ALIGNMENT)")
        if p.q_words:
            w.line(f"q_sh = cuda.shared.array({p.q_words}, np.uint32, alignment=COPY_ALIGNMENT)")
        k_row, v_row = self.row_bytes(p.head_dim), self.row_bytes(p.value_dim)
        w.line(f"lm_j = {quotient('lane', LDMATRIX_X4.rows)}  # the matrix whose row this lane addresses")
        w.line(f"lm_r = {remainder('lane', LDMATRIX_X4.rows)}")
        # values: matrix j is keys 8 (j % 2) .. of chunk j // 2 (b0, b1 of two n tiles)
        pair_rows, half = f"{remainder('lm_j', 2)} * {atom.k // 2} + lm_r", quotient("lm_j", 2)
        for base in range(0, SWIZZLE, 2):
            w.line(f"v_lane_{base} = ({pair_rows}) * {v_row} + {swizzled('lm_r', f'{base} + {half}')}")
        # keys: matrix j is chunk j of a key's row (b0, b1 of two k steps); two patterns by chunk bit 2
        for base in range(0, SWIZZLE, 4):
            w.line(f"k_lane_{base} = lm_r * {k_row} + {swizzled('lm_r', f'{base} + lm_j')}")
        if p.q_words:
            # the query: matrix j is rows 8 (j % 2) .. of chunk j // 2 of a k step (a0 .. a3), from this warp's rows
            assert atom.a.offsets == tuple((j % 2 * 8, j // 2 * COPY_ELEMENTS) for j in range(4))
            at = f"((tid >> 5) * {p.warp_rows} + {pair_rows}) * {self.row_bytes(p.head_dim)}"
            for base in range(0, SWIZZLE, 2):
                w.line(f"q_lane_{base} = {at} + {swizzled('lm_r', f'{base} + {half}')}")
        self.copy_lanes()

    @staticmethod
    def row_bytes(dim: int) -> int:
        return 2 * dim

    def copy_lanes(self) -> None:
        """Where each thread's copies start: its chunk of a row, its first row, and their place."""
        p, w = self.mp, self.w
        for name, dim in (("k", p.head_dim), ("v", p.value_dim)):
            load = self.tile_load(name)
            per_row = dim // COPY_ELEMENTS
            w.line(f"{name}_col = {remainder('tid', per_row)}")
            w.line(f"{name}_row = {quotient('tid', per_row)}")
            w.line(f"{name}_dst = {name}_row * {self.row_bytes(dim)} + {swizzled(f'{name}_row', f'{name}_col')}")
            view = self.page_view(load)
            if view is not None:
                self.page_lanes(name, load, view)
            else:
                w.line(f"{name}_rows = {self.slice_of(load)}  # this head's rows, dense")
                if self.pitched:
                    w.line(f"{name}_pitch = {row_pitch(f'{name}_rows')}")

    def tile_load(self, name: str) -> Op:
        """The key ("k") or value ("v") tile load."""
        return self.t.masked.k_load if name == "k" else self.t.masked.v_load

    def copies(self, name: str, dim: int, jc: str, full: bool = False) -> None:
        """The copies of keys ``jc ..`` of a chunk into ``{name}_sh`` and their commit, from one offset
        and constant steps, each copy of a row past the keys' end reading nothing (zero-filled): one
        code for whole and last chunks.  ``full``: a whole chunk, known to be (no compares)."""
        p, w = self.mp, self.w
        per_row = dim // COPY_ELEMENTS
        step = p.threads // per_row
        rows = [
            (n * step, f"{name}_row + {n * step}" if n else f"{name}_row")
            for n in range(p.chunk * per_row // p.threads)
        ]
        if self.page_view(self.tile_load(name)) is not None:
            self.page_copies(name, dim, jc, rows)
            return
        # 32 bits (a head's keys times features are fewer than 2^31): 32-bit index arithmetic
        pitch = f"{name}_pitch" if self.pitched else str(dim)
        w.line(f"src_at = np.int32(({jc} + {name}_row) * {pitch} + {name}_col * {COPY_ELEMENTS})")
        if not full:  # rows past the keys' end: zero-filled, their source not read (``cp_async16``)
            w.line(f"past = np.int32(n_keys - ({jc}) - {name}_row)")
        for at, row in rows:
            dst = self.copy_destination(name, dim, at, row)
            size = str(CHUNK_BYTES) if full else f"select({at} < past, {CHUNK_BYTES}, 0)"
            step = f"np.int32({at}) * {pitch}" if self.pitched else str(at * dim)
            w.line(f"cp_async16({name}_sh, {dst}, {name}_rows, src_at + {step}, {size})")
        w.line("cp_async_commit()")

    def batch_decode(self, rank: int) -> list[str]:
        """As the scalar kernel's, in 32-bit unsigned divisions (a grid's blocks and a batch's axes are
        fewer than 2^32): a few instructions each, not a 64-bit division's routine."""
        w = self.w
        w.line("task32 = np.uint32(task)")
        w.line("n_qb32 = np.uint32(n_qb)")
        w.line("qb = n_qb - 1 - task32 % n_qb32")
        names = [f"bi_{k}" for k in range(rank)]
        flat = "task32 // n_qb32"
        for k in reversed(range(rank)):
            w.line(f"rest_{k} = {flat}")
            if k == 0:  # the grid's blocks are the units (``AttentionKernels.launch``): within the axis
                w.line(f"{names[k]} = rest_{k}")
                break
            w.line(f"axis_{k} = np.uint32(out_0.shape[{k}])")
            w.line(f"{names[k]} = rest_{k} % axis_{k}")
            flat = f"rest_{k} // axis_{k}"
        return names

    def program_position(self, block_q: int) -> None:
        if self.packed:  # a (batch position, key/value head) a block, its group's rows packed
            self.packed_position()
        else:
            super().program_position(block_q)

    def load_query(self) -> None:
        """This lane's A fragments of its warp's 16 query rows, a 32-bit load a register (the query's
        rows are dense too; rows past the end read the last); several tiles a warp: the block's query
        rows copied into ``q_sh`` (:meth:`query_copies`); packed heads: ``packed_query``."""
        p, w, atom = self.mp, self.w, self.atom
        if self.packed:
            self.packed_query()
            return
        w.line(f"q_rows = {self.slice_of(self.t.q_load)}")
        if p.q_words:
            self.query_copies()
            return
        row0 = self.ref(self.t.q_load.operands[-1])
        for name in ROW_NAMES.values():  # from this lane's first column: constant offsets
            # unsigned: no negative-index fix-ups (64-bit, per index) on the way to the row's address
            row = f"U(min({row0} + r{name}, n_rows - 1))"
            w.line(f"q_lane_{name} = q_rows[{row}, U({atom.a.col_term}):]")
        for kc in range(p.head_dim // atom.k):
            for reg, (row, col) in enumerate(atom.a.offsets):
                w.line(f"q_{kc}_{reg} = load_pair16(q_lane_{ROW_NAMES[row]}, {kc * atom.k + col})")

    def query_copies(self) -> None:
        """The block's query rows into the swizzled ``q_sh`` (rows past the end zero), one group, landed
        by the first chunk's wait; the A fragments are read from it at each product (``score_products``)."""
        p, w = self.mp, self.w
        per_row = p.head_dim // COPY_ELEMENTS
        step = p.threads // per_row
        w.line(f"q_col = {remainder('tid', per_row)}")
        w.line(f"q_row = {quotient('tid', per_row)}")
        w.line(f"q_dst = q_row * {self.row_bytes(p.head_dim)} + {swizzled('q_row', 'q_col')}")
        # 32 bits, as the keys' copies: one offset and constant steps; rows past the end read nothing
        w.line("q_past = np.int32(n_rows - i0 - q_row)")
        if self.pitched:
            w.line(f"q_pitch = {row_pitch('q_rows')}")
        pitch = "q_pitch" if self.pitched else str(p.head_dim)
        w.line(f"q_at = np.int32((i0 + q_row) * {pitch} + q_col * {COPY_ELEMENTS})")
        for n in range(p.rows // step):
            row = f"q_row + {n * step}" if n else "q_row"
            dst = self.copy_destination("q", p.head_dim, n * step, row)
            size = f"{CHUNK_BYTES} if {n * step} < q_past else 0"
            at = f"np.int32({n * step}) * q_pitch" if self.pitched else str(n * step * p.head_dim)
            w.line(f"cp_async16(q_sh, {dst}, q_rows, q_at + {at}, {size})")
        w.line("cp_async_commit()")

    def query_address(self, tile: int, kc: int) -> str:
        """This lane's ldmatrix address of tile ``tile``'s A fragment of k step ``kc`` in ``q_sh``."""
        chunk = kc * self.atom.k // COPY_ELEMENTS
        at = tile * self.atom.m * self.row_bytes(self.mp.head_dim) + (chunk & ~SWIZZLED) * CHUNK_BYTES
        return f"q_lane_{chunk & SWIZZLED} + {at}"

    def copy_destination(self, name: str, dim: int, at: int, row: str) -> str:
        """Where a thread's copy of row ``row`` (``at`` rows past its first) goes: its first copy's
        place plus a constant where ``at`` keeps the swizzle (a multiple of its rows), so that one
        register serves every copy."""
        if at % SWIZZLE == 0:
            return f"{name}_dst + {at * self.row_bytes(dim)}" if at else f"{name}_dst"
        return f"({row}) * {self.row_bytes(dim)} + {swizzled(row, f'{name}_col')}"

    def scores(self, compute: TileCompute, masked: str | None, hoisted: dict[Op, list[Op]], full: bool = False) -> None:
        """The score region on every element a lane holds; then, in one branch taken by masked tiles
        and the chunk holding the last key only, the mask region and keys past the end (the mask is
        exact everywhere, so evaluating it in a full tile's last chunk changes nothing).  ``full``:
        a whole chunk of a full tile, the score region alone."""
        p, w, c = self.mp, self.w, self.atom.c
        # positions in 32 bits (a sequence is shorter than 2^31): one compare a masked element
        rows, cols, elements = self.scored(compute, hoisted, cast="np.int32", raw=full and self.scale is not None)
        if full:
            return
        mask = compute.mask if masked is not None else None
        tail = f"jc + {p.chunk} > n_keys"
        w.line(f"if {tail}{f' or {masked}' if mask is not None else ''}:  # masked, or keys past the end")
        with w.indent():
            inside = {}
            for n in range(p.chunk // c.cols):
                for half in c.columns():
                    inside[n, half] = self.fresh("k")
                    w.line(f"{inside[n, half]} = jc + {n * c.cols + half} + {c.col_term} < n_keys")
            for t, n, e in elements:
                visible = inside[n, c.offsets[e][1]]
                if mask is not None:
                    at = [rows[f"r{row_letter(t, e)}"], cols[n, c.offsets[e][1]]]
                    visible = f"{visible} & ({self.apply(mask, hoisted[mask], at)})"
                s = f"{tile_name('s', t)}_{n}_{e}"
                w.line(f"{s} = select({visible}, {s}, NEG_INF)")

    # fragments from shared memory ---------------------------------------------------
    def score_products(self) -> None:
        """``s_{n}_{e}`` (each tile's) from ldmatrix.x4 of the key tile: four chunks of 8 keys' rows, the
        B fragments of two k steps, each feeding every tile's products.  The query's A fragments are
        kept in registers, or (several tiles a warp) read from ``q_sh`` for each pair of k steps."""
        p, w, atom = self.mp, self.w, self.atom
        k_row = self.row_bytes(p.head_dim)
        pairs, keys = range(0, p.head_dim // atom.k, 2), range(p.chunk // atom.n)
        order = [(kc, n) for kc in pairs for n in keys] if p.q_words else [(kc, n) for n in keys for kc in pairs]
        for kc, n in order:
            if p.q_words and n == 0:  # the pair's A fragments of every tile
                for tile in range(p.m_tiles):
                    for step in (kc, kc + 1):
                        regs = ", ".join(self.query_fragment(tile, step))
                        w.line(f"{regs} = ldmatrix_x4(q_sh, {self.query_address(tile, step)})")
            chunk = kc * atom.k // COPY_ELEMENTS
            at = n * atom.n * k_row + (chunk & ~SWIZZLED) * CHUNK_BYTES
            w.line(f"kf0, kf1, kf2, kf3 = ldmatrix_x4(k_sh, k_lane_{chunk & SWIZZLED & ~3} + {at})")
            for tile in range(p.m_tiles):
                s = ", ".join(f"{tile_name('s', tile)}_{n}_{e}" for e in range(atom.c.registers))
                for step, b in ((kc, "kf0, kf1"), (kc + 1, "kf2, kf3")):
                    acc = s if step else "ZERO, ZERO, ZERO, ZERO"
                    w.line(f"{s} = {self.operands.mma}({', '.join(self.query_fragment(tile, step))}, {b}, {acc})")

    def query_fragment(self, tile: int, kc: int) -> list[str]:
        """The registers of tile ``tile``'s A fragment of k step ``kc``: kept (one tile a warp), or the
        pair of k steps just read from ``q_sh``."""
        regs = range(self.atom.a.registers)
        if self.mp.q_words:
            return [f"{tile_name('qf', tile)}_{kc % 2}_{r}" for r in regs]
        return [f"q_{kc}_{r}" for r in regs]

    def value_products(self) -> None:
        """``o_{en}_{e} += P V`` (each tile's) with the B fragments from ldmatrix.x4.trans of the value
        tile: keys 16 kk .. of two 8-feature chunks, each feeding every tile's products."""
        p, w, atom = self.mp, self.w, self.atom
        v_row = self.row_bytes(p.value_dim)
        for tile in range(p.m_tiles):
            sn, pn = tile_name("s", tile), tile_name("p", tile)
            for kk in range(p.chunk // atom.k):
                for reg, halves in enumerate(atom.feed()):
                    pair = ", ".join(f"{sn}_{atom.tiles * kk + t}_{e}" for t, e in halves)
                    w.line(f"{pn}_{kk}_{reg} = {self.operands.pack}({pair})")
        for en in range(0, p.value_dim // atom.n, 2):
            for kk in range(p.chunk // atom.k):
                at = kk * atom.k * v_row + (en & ~SWIZZLED) * CHUNK_BYTES
                w.line(f"vf0, vf1, vf2, vf3 = ldmatrix_x4_trans(v_sh, v_lane_{en & SWIZZLED} + {at})")
                for tile in range(p.m_tiles):
                    pn, on = tile_name("p", tile), tile_name("o", tile)
                    a = ", ".join(f"{pn}_{kk}_{r}" for r in range(atom.a.registers))
                    for n, b in ((en, "vf0, vf1"), (en + 1, "vf2, vf3")):
                        o = ", ".join(f"{on}_{n}_{e}" for e in range(atom.c.registers))
                        w.line(f"{o} = {self.operands.mma}({a}, {b}, {o})")

    # the finish ---------------------------------------------------------------------
    def partial_outputs(self, halves: tuple[int, ...], tile: int = 0) -> None:
        """As the staged kernel, from a slice at this lane's first column: constant offsets."""
        c, on = self.atom.c, tile_name("o", tile)
        self.w.line(f"part_lane = part_o[sp, flat, {c.col_term}:]")
        for en in range(self.mp.value_dim // c.cols):
            for e in halves:
                self.w.line(f"part_lane[{en * c.cols + c.offsets[e][1]}] = {on}_{en}_{e}")

    def row_outputs(self, denominator: str, at: str, halves: tuple[int, ...], tile: int = 0) -> None:
        """A 16-bit row's outputs times ``1 / l``, two neighbouring columns rounded together and
        stored as one 32-bit word, from a slice at this lane's first column (a float32 output: as the
        staged kernel)."""
        c, w = self.atom.c, self.w
        # bf16 outputs are written as their patterns (``out_bits``: the IR here is widened to float32)
        out = "bf16" if self.out_bits else self.t.grid.results[0].type.dtype
        if out not in ("f16", "bf16"):
            super().row_outputs(denominator, at, halves, tile)
            return
        low, high = (c.offsets[e][1] for e in halves)
        assert high == low + 1  # a lane's two columns of a row are neighbours
        w.line(f"inverse = rcp_approx({denominator})  # within an ulp: the output is rounded to 16 bits")
        # unsigned: no negative-index fix-ups (64-bit, per index) on the way to the row's address
        index = ", ".join(f"U({x})" for x in at.split(", "))
        w.line(f"out_lane = out_0[{index}, U({c.col_term}):]")
        on = tile_name("o", tile)
        for en in range(self.mp.value_dim // c.cols):
            pair = ", ".join(f"{on}_{en}_{e} * inverse" for e in halves)
            w.line(f"store_pair16(out_lane, {en * c.cols + low}, pack_{out}x2({pair}))")


assert M16N8K16.k == 2 * COPY_ELEMENTS  # a k step is two 16-byte chunks of a row
