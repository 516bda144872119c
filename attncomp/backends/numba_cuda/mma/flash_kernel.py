"""The tensor-core forward at FlashAttention-2's design: asynchronous copies, ldmatrix, swizzled tiles.

The products, the scores, the online softmax and the finish are ``mma/forward_kernel.py``'s; what
changes is how keys and values reach the B fragments.  Where a call's query, key and value rows are dense (the
last two axes of each array contiguous, 16-byte aligned: ``arrays.dense_rows``) and D and E are
multiples of 64, each thread issues a fixed number of 16-byte ``cp.async`` copies per chunk
(``atoms.CP_ASYNC_16``), with zero fill past the last key, into shared tiles kept row by row as
the arrays are (``k_sh[key, d]``, ``v_sh[key, e]``): no transposed copy.  A row's 16-byte chunk
``c`` is stored at chunk ``c ^ (row % 8)`` (an XOR swizzle), so that the eight rows an ``ldmatrix``
phase reads, and the eight chunks a quarter-warp of copies writes, fall in distinct banks.  The B
fragments come from ``ldmatrix.x4`` (keys) and ``ldmatrix.x4.trans`` (values), four registers an
instruction, from addresses a lane computes once (``shared_arrays``) plus constants.

One buffer of keys and one of values, as FlashAttention-2 does, so that the copies of one overlap
the products of the other:

    K(first) in flight
    for each chunk i (computed tiles only: a skipped tile's keys are never copied):
        wait for K(i); barrier          # K(i) seen by all; every warp done with V(i - 1)
        V(i) in flight
        S = Q K(i)^T (ldmatrix)         # overlaps V(i)'s copy
        scores, mask, keys past the end
        the next chunk to compute       # its tile's class, found by the IR's classification
        wait for V(i); barrier          # V(i) seen by all; every warp done with K(i)
        K(i + 1) in flight
        online softmax; O += P V(i)     # overlaps K(i + 1)'s copy

Whole chunks of full tiles (class 2: no mask) run in a loop of their own, the main loop, as
FlashAttention-2 runs its unmasked iterations: at the start of a run the tiles ahead are classified
once to find where it ends (a tile that is masked or skipped, or the last whole chunk before the
keys' end), and the chunk after it; each iteration then has no mask, no keys past the end and no
classification, and copies the next chunk's keys without a check.  Where the score region is
``s * c`` with ``c`` never negative (``passes/signs.py``: ``D ** -0.5``), the main loop leaves the
products unscaled: the row's max is of the products, then scaled (``max(c s) = c max(s)``), and
``c log2 e`` is the multiplier of the exponent's one multiply-add.  Every other chunk (masked
tiles, the tail, a grid without full tiles) runs the general body above.

A launch of one key split (its thread blocks fill the GPU, as a long prefill's) runs a kernel
without the split range, the partial states and the merge (``KernelChoice.key_splits``).

A thread's copies of a whole chunk go from one offset into its (batch, head) slice and one shared
address, plus constants the instructions carry; the offset in 32 bits (a head's keys times
features are fewer than 2^31).  Under Numba's CUDA simulator the copies and ldmatrix
run ``mma/warp_sim_copies.py``'s emulation, which lands a copy only at its wait and counts bank
conflicts (``tests/cuda_sim/test_sim_flash.py`` asserts none).
"""

from __future__ import annotations

from attncomp.backends.numba_cuda.mma.atoms import LDMATRIX_X4, M16N8K16
from attncomp.backends.numba_cuda.mma.forward_kernel import MmaKernelWriter
from attncomp.backends.numba_cuda.mma.forward_plan import COPY_ELEMENTS
from attncomp.backends.numba_cuda.mma.fragment_rows import ROW, ROW_NAMES
from attncomp.backends.tiles import TileCompute
from attncomp.ir.core import Op, Value
from attncomp.passes.mask_elimination import FULL
from attncomp.passes.signs import nonnegative

#: bytes of one copy and of one ldmatrix row: a 16-byte chunk of eight 16-bit elements
CHUNK_BYTES = 2 * COPY_ELEMENTS
#: rows of one swizzle pattern: a chunk's place is ``chunk ^ (row % SWIZZLE)``
SWIZZLE = LDMATRIX_X4.rows
#: the chunk index bits the swizzle changes (chunks 0 .. 7 of each 128 bytes)
SWIZZLED = SWIZZLE - 1


def quotient(x: str, n: int) -> str:
    """``x // n`` for a non-negative ``x``: a shift where ``n`` is a power of two."""
    return f"({x} >> {n.bit_length() - 1})" if n & (n - 1) == 0 else f"({x} // {n})"


def remainder(x: str, n: int) -> str:
    """``x % n`` for a non-negative ``x``: a mask where ``n`` is a power of two."""
    return f"({x} & {n - 1})" if n & (n - 1) == 0 else f"({x} % {n})"


def swizzled(row: str, chunk: str) -> str:
    """The byte offset of 16-byte chunk ``chunk`` of row ``row`` within that row (expressions)."""
    return f"((({chunk}) ^ (({row}) & {SWIZZLED})) * {CHUNK_BYTES})"


class FlashKernelWriter(MmaKernelWriter):
    """Writes the asynchronous-copy tensor-core kernel of one tiled attention (see the module)."""

    def shared_arrays(self) -> None:
        """The key and value tiles, and each lane's ldmatrix addresses into them."""
        p, w, atom = self.mp, self.w, self.atom
        # 16-byte aligned (``warp.COPY_ALIGNMENT``): a copy's destination and an ldmatrix row are
        w.line(f"k_sh = cuda.shared.array({p.k_words}, np.uint32, alignment=COPY_ALIGNMENT)")
        w.line(f"v_sh = cuda.shared.array({p.v_words}, np.uint32, alignment=COPY_ALIGNMENT)")
        k_row, v_row = self.row_bytes(p.head_dim), self.row_bytes(p.value_dim)
        w.line(f"lm_j = {quotient('lane', LDMATRIX_X4.rows)}  # the matrix whose row this lane addresses")
        w.line(f"lm_r = {remainder('lane', LDMATRIX_X4.rows)}")
        # keys: matrix j is chunk j of a key's row (b0, b1 of two k steps); two patterns by chunk bit 2
        for base in range(0, SWIZZLE, 4):
            w.line(f"k_lane_{base} = lm_r * {k_row} + {swizzled('lm_r', f'{base} + lm_j')}")
        # values: matrix j is keys 8 (j % 2) .. of chunk j // 2 (b0, b1 of two n tiles)
        for base in range(0, SWIZZLE, 2):
            at = f"({remainder('lm_j', 2)} * {atom.k // 2} + lm_r) * {v_row}"
            half = quotient("lm_j", 2)
            w.line(f"v_lane_{base} = {at} + {swizzled('lm_r', f'{base} + {half}')}")
        self.copy_lanes()

    @staticmethod
    def row_bytes(dim: int) -> int:
        return 2 * dim

    def copy_lanes(self) -> None:
        """Where each thread's copies start: its chunk of a row, its first row, and their place."""
        p, w = self.mp, self.w
        for name, load, dim in (("k", self.t.masked.k_load, p.head_dim), ("v", self.t.masked.v_load, p.value_dim)):
            per_row = dim // COPY_ELEMENTS
            w.line(f"{name}_col = {remainder('tid', per_row)}")
            w.line(f"{name}_row = {quotient('tid', per_row)}")
            w.line(f"{name}_dst = {name}_row * {self.row_bytes(dim)} + {swizzled(f'{name}_row', f'{name}_col')}")
            w.line(f"{name}_rows = {self.slice_of(load)}  # this head's rows, dense")

    def slice_of(self, load: Op) -> str:
        """The (keys, features) array a tile load reads, for this program's batch position."""
        src = self.array_ref(load.operands[0])
        prefix = ", ".join(self.ref(v) for v in load.operands[1:-1])
        return f"{src}[{prefix}]" if prefix else src

    def copies(self, name: str, dim: int, jc: str, full: bool = False) -> None:
        """The copies of keys ``jc ..`` of a chunk into ``{name}_sh`` and their commit: a whole chunk
        from one offset and constant steps; the last one with rows past the end zero-filled (their
        source clamped to the last key).  ``full``: a whole chunk, known to be."""
        p, w = self.mp, self.w
        per_row = dim // COPY_ELEMENTS
        step = p.threads // per_row
        rows = [
            (n * step, f"{name}_row + {n * step}" if n else f"{name}_row")
            for n in range(p.chunk * per_row // p.threads)
        ]
        # 32 bits (a head's keys times features are fewer than 2^31): 32-bit index arithmetic
        w.line(f"src_at = np.int32(({jc} + {name}_row) * {dim} + {name}_col * {COPY_ELEMENTS})")
        if full:
            for at, row in rows:
                dst = self.copy_destination(name, dim, at, row)
                w.line(f"cp_async16({name}_sh, {dst}, {name}_rows, src_at + {at * dim}, {CHUNK_BYTES})")
            w.line("cp_async_commit()")
            return
        w.line(f"if {jc} + {p.chunk} <= n_keys:")
        with w.indent():
            for at, row in rows:
                dst = self.copy_destination(name, dim, at, row)
                w.line(f"cp_async16({name}_sh, {dst}, {name}_rows, src_at + {at * dim}, {CHUNK_BYTES})")
        w.line("else:")
        with w.indent():
            for at, row in rows:
                w.line(f"jj = {jc} + {row}")
                src = f"min(jj, n_keys - 1) * {dim} + {name}_col * {COPY_ELEMENTS}"
                dst = self.copy_destination(name, dim, at, row)
                w.line(f"cp_async16({name}_sh, {dst}, {name}_rows, {src}, {CHUNK_BYTES} if jj < n_keys else 0)")
        w.line("cp_async_commit()")

    def load_query(self) -> None:
        """This lane's A fragments of its warp's 16 query rows, a 32-bit load a register (the query's
        rows are dense too; rows past the end read the last)."""
        p, w, atom = self.mp, self.w, self.atom
        w.line(f"q_rows = {self.slice_of(self.t.q_load)}")
        row0 = self.ref(self.t.q_load.operands[-1])
        for name in ROW_NAMES.values():  # from this lane's first column: constant offsets
            w.line(f"q_lane_{name} = q_rows[min({row0} + r{name}, n_rows - 1), {atom.a.col_term}:]")
        for kc in range(p.head_dim // atom.k):
            for reg, (row, col) in enumerate(atom.a.offsets):
                w.line(f"q_{kc}_{reg} = load_pair16(q_lane_{ROW_NAMES[row]}, {kc * atom.k + col})")

    def copy_destination(self, name: str, dim: int, at: int, row: str) -> str:
        """Where a thread's copy of row ``row`` (``at`` rows past its first) goes: its first copy's
        place plus a constant where ``at`` keeps the swizzle (a multiple of its rows), so that one
        register serves every copy."""
        if at % SWIZZLE == 0:
            return f"{name}_dst + {at * self.row_bytes(dim)}" if at else f"{name}_dst"
        return f"({row}) * {self.row_bytes(dim)} + {swizzled(row, f'{name}_col')}"

    # the pipelined key loop ----------------------------------------------------------
    def classify(self, var: str, cls: str) -> None:
        """The class of key block ``var`` into ``cls`` (the IR's classification code)."""
        t = self.t
        loop_arg = t.loop.regions[0].args[0]
        self.names[loop_arg] = var
        for op in t.classify_ops:
            self.scalar().op(op)
        self.w.line(f"{cls} = {self.scalar().ref(t.tile_class)}")
        self.names[loop_arg] = "kb"

    def next_computed(self, var: str, cls: str) -> None:
        """Advance ``var`` (a key block) to the first computed tile at or after it (``kb_hi`` if
        none), its class into ``cls``; without a classification, every tile is computed."""
        t, w = self.t, self.w
        if t.tile_class is None:
            w.line(f"{cls} = {t.default_class}")
            return
        w.line(f"{cls} = 0")
        w.line(f"while {var} < kb_hi:")
        with w.indent():
            self.classify(var, cls)
            w.line(f"if {cls} != 0:")
            with w.indent():
                w.line("break")
            w.line(f"{var} += 1")

    @property
    def scale(self) -> Value | None:
        """The factor ``c`` of a score region that is ``s * c`` with ``c`` never negative and the
        same for every element (``passes/signs.py``): the main loop folds it into the softmax."""
        region = self.t.masked.score.regions[0]
        *_, s = region.args
        if [op.name for op in region.ops] != ["ac.mul", "ac.yield"]:
            return None
        mul, done = region.ops
        if done.operands[0] is not mul.results[0] or s not in mul.operands:
            return None
        (c,) = [x for x in mul.operands if x is not s] or [s]
        outside = c.owner is not None and c.owner not in region.ops and c not in region.args
        return c if outside and c.type.rank == 0 and nonnegative(c) else None

    @property
    def full_runs(self) -> bool:
        """Whether tiles can be full (class 2): runs of them get a loop of their own."""
        t = self.t
        return t.tile_class is not None or t.default_class == FULL

    def key_loop(self, hoisted: dict[Op, list[Op]]) -> None:
        """The computed chunks in order, ``K(i)`` in flight at the top of each: a run of whole chunks
        of full tiles in a loop of its own (no mask, no keys past the end, no classification: the
        main loop), every other chunk in the general body."""
        p, w, t = self.mp, self.w, self.t
        if self.full_runs and self.scale is not None:
            w.line(f"scale_log2 = ACC({self.ref(self.scale)}) * LOG2E  # the scores' scale, folded")
        w.line("# the first chunk to compute, its keys in flight")
        w.line("kb = kb_lo")
        self.next_computed("kb", "cls")
        w.line("c0 = 0")
        w.line("if kb < kb_hi:")
        with w.indent():
            self.copies("k", p.head_dim, f"kb * {p.block_k}")
        w.line("while kb < kb_hi:")
        with w.indent():
            self.names[t.loop.regions[0].args[0]] = "kb"
            if self.full_runs:
                w.line(f"if cls == {FULL} and kb * {p.block_k} + c0 + {p.chunk} <= n_keys:")
                with w.indent():
                    self.full_run(hoisted)
                w.line("else:")
                with w.indent():
                    self.general_chunk(hoisted)
            else:
                self.general_chunk(hoisted)

    def full_run(self, hoisted: dict[Op, list[Op]]) -> None:
        """The run of full tiles from ``kb``: its whole chunks ``[jc, run_end)``, one iteration each,
        then the chunk after it (``akb``, ``ac0``, ``acls``) is the loop's."""
        p, w, t = self.mp, self.w, self.t
        compute = t.masked
        w.line("rk = kb + 1  # the run: full tiles from kb")
        if t.tile_class is not None:
            w.line("while rk < kb_hi:")
            with w.indent():
                self.classify("rk", "rcls")
                w.line(f"if rcls != {FULL}:")
                with w.indent():
                    w.line("break")
                w.line("rk += 1")
        else:
            w.line("rk = kb_hi")
        w.line(f"run_end = min(rk * {p.block_k}, n_keys // {p.chunk} * {p.chunk})  # whole chunks only")
        w.line("# the chunk after the run: the rest of its last tile (keys past the end), else the next computed tile")
        w.line(f"if run_end < rk * {p.block_k}:")
        with w.indent():
            w.line(f"akb = run_end // {p.block_k}")
            w.line(f"ac0 = run_end - akb * {p.block_k}")
            w.line(f"acls = {FULL}")
        w.line("else:")
        with w.indent():
            w.line("akb = rk")
            w.line("ac0 = 0")
            self.next_computed("akb", "acls")
        w.line("while True:  # the main loop")
        with w.indent():
            for op in compute.scalar_ops:
                self.scalar().op(op)
            j0 = self.ref(compute.k_load.operands[-1])
            w.line(f"jc = {j0} + c0")
            self.chunk_start("jc", full=True)
            self.scores(compute, None, hoisted, full=True)
            w.line(f"c0 += {p.chunk}")
            w.line(f"if c0 == {p.block_k}:")
            with w.indent():
                w.line("kb += 1")
                w.line("c0 = 0")
            w.line(f"more = jc + {p.chunk} < run_end")
            w.line("cp_async_wait(0)")
            w.line("cuda.syncthreads()  # V seen by every warp; every warp done with K")
            w.line("if more:")
            with w.indent():
                self.copies("k", p.head_dim, f"jc + {p.chunk}", full=True)
            self.chunk_end("scale_log2" if self.scale is not None else None)
            w.line("if not more:")
            with w.indent():
                w.line("break")
        w.line("# K of the chunk after the run (every warp is past the barrier after its last use of K)")
        w.line("if akb < kb_hi:")
        with w.indent():
            self.copies("k", p.head_dim, f"akb * {p.block_k} + ac0")
        w.line("kb = akb")
        w.line("c0 = ac0")
        w.line("cls = acls")

    def chunk_start(self, jc: str, full: bool = False) -> None:
        """Wait for K(i), V(i) in flight, S = Q K(i)^T."""
        p, w = self.mp, self.w
        w.line("cp_async_wait(0)")
        w.line("cuda.syncthreads()  # K seen by every warp; every warp done with the previous V")
        self.copies("v", p.value_dim, jc, full=full)
        w.line("# S = Q K^T")
        self.score_products()

    def chunk_end(self, scale: str | None = None) -> None:
        """The online softmax (``scale``: folded into it) and O += P V(i)."""
        self.softmax_update(scale)
        self.w.line("# O += P V")
        self.value_products()

    def general_chunk(self, hoisted: dict[Op, list[Op]]) -> None:
        """One chunk of any computed tile: the mask where the tile's class says, keys past the end
        hidden; then the next chunk: of this tile, else the next computed tile."""
        p, w, t = self.mp, self.w, self.t
        compute = t.masked
        for op in compute.scalar_ops:
            self.scalar().op(op)
        w.line(f"jc = {self.ref(compute.k_load.operands[-1])} + c0")
        self.chunk_start("jc")
        masked = None if compute.mask is None else "cls == 1"
        if t.tile_class is None:
            masked = "True" if t.default_class == 1 and compute.mask is not None else None
        self.scores(compute, masked, hoisted)
        w.line("# the next chunk: of this tile, else the next computed tile")
        w.line(f"nkb = kb if c0 + {p.chunk} < {p.block_k} and jc + {p.chunk} < n_keys else kb + 1")
        w.line(f"nc0 = c0 + {p.chunk} if nkb == kb else 0")
        w.line("ncls = cls")
        w.line("if nkb != kb:")
        with w.indent():
            self.next_computed("nkb", "ncls")
        w.line("cp_async_wait(0)")
        w.line("cuda.syncthreads()  # V seen by every warp; every warp done with K")
        w.line("if nkb < kb_hi:")
        with w.indent():
            self.copies("k", p.head_dim, f"nkb * {p.block_k} + nc0")
        self.chunk_end()
        w.line("kb = nkb")
        w.line("c0 = nc0")
        w.line("cls = ncls")

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
            for n, e in elements:
                visible = inside[n, c.offsets[e][1]]
                if mask is not None:
                    at = [rows[ROW[e]], cols[n, c.offsets[e][1]]]
                    visible = f"{visible} and {self.apply(mask, hoisted[mask], at)}"
                w.line(f"if not ({visible}):")
                with w.indent():
                    w.line(f"s_{n}_{e} = NEG_INF")

    # fragments from shared memory ---------------------------------------------------
    def score_products(self) -> None:
        """``s_{n}_{e}`` from ldmatrix.x4 of the key tile: four chunks of 8 keys' rows, the B
        fragments of two k steps."""
        p, w, atom = self.mp, self.w, self.atom
        k_row = self.row_bytes(p.head_dim)
        for n in range(p.chunk // atom.n):
            for kc in range(0, p.head_dim // atom.k, 2):
                chunk = kc * atom.k // COPY_ELEMENTS
                at = n * atom.n * k_row + (chunk & ~SWIZZLED) * CHUNK_BYTES
                w.line(f"kf0, kf1, kf2, kf3 = ldmatrix_x4(k_sh, k_lane_{chunk & SWIZZLED & ~3} + {at})")
                s = ", ".join(f"s_{n}_{e}" for e in range(atom.c.registers))
                for step, b in ((kc, "kf0, kf1"), (kc + 1, "kf2, kf3")):
                    acc = s if step else "ZERO, ZERO, ZERO, ZERO"
                    a = ", ".join(f"q_{step}_{r}" for r in range(atom.a.registers))
                    w.line(f"{s} = {self.operands.mma}({a}, {b}, {acc})")

    def value_products(self) -> None:
        """``o_{en}_{e} += P V`` with the B fragments from ldmatrix.x4.trans of the value tile: keys
        16 kk .. of two 8-feature chunks."""
        p, w, atom = self.mp, self.w, self.atom
        v_row = self.row_bytes(p.value_dim)
        for kk in range(p.chunk // atom.k):
            for reg, halves in enumerate(atom.feed()):
                pair = ", ".join(f"s_{atom.tiles * kk + tile}_{e}" for tile, e in halves)
                w.line(f"p_{kk}_{reg} = {self.operands.pack}({pair})")
        for en in range(0, p.value_dim // atom.n, 2):
            for kk in range(p.chunk // atom.k):
                at = kk * atom.k * v_row + (en & ~SWIZZLED) * CHUNK_BYTES
                w.line(f"vf0, vf1, vf2, vf3 = ldmatrix_x4_trans(v_sh, v_lane_{en & SWIZZLED} + {at})")
                a = ", ".join(f"p_{kk}_{r}" for r in range(atom.a.registers))
                for tile, b in ((en, "vf0, vf1"), (en + 1, "vf2, vf3")):
                    o = ", ".join(f"o_{tile}_{e}" for e in range(atom.c.registers))
                    w.line(f"{o} = {self.operands.mma}({a}, {b}, {o})")

    # the finish ---------------------------------------------------------------------
    def partial_outputs(self, halves: tuple[int, ...]) -> None:
        """As the staged kernel, from a slice at this lane's first column: constant offsets."""
        c = self.atom.c
        self.w.line(f"part_lane = part_o[sp, flat, {c.col_term}:]")
        for en in range(self.mp.value_dim // c.cols):
            for e in halves:
                self.w.line(f"part_lane[{en * c.cols + c.offsets[e][1]}] = o_{en}_{e}")

    def row_outputs(self, denominator: str, at: str, halves: tuple[int, ...]) -> None:
        """A 16-bit row's outputs times ``1 / l``, two neighbouring columns rounded together and
        stored as one 32-bit word, from a slice at this lane's first column (a float32 output: as the
        staged kernel)."""
        c, w = self.atom.c, self.w
        # bf16 outputs are written as their patterns (``out_bits``: the IR here is widened to float32)
        out = "bf16" if self.out_bits else self.t.grid.results[0].type.dtype
        if out not in ("f16", "bf16"):
            super().row_outputs(denominator, at, halves)
            return
        low, high = (c.offsets[e][1] for e in halves)
        assert high == low + 1  # a lane's two columns of a row are neighbours
        w.line(f"inverse = ACC(1.0) / {denominator}")
        w.line(f"out_lane = out_0[{at}, {c.col_term}:]")
        for en in range(self.mp.value_dim // c.cols):
            pair = ", ".join(f"o_{en}_{e} * inverse" for e in halves)
            w.line(f"store_pair16(out_lane, {en * c.cols + low}, pack_{out}x2({pair}))")


assert M16N8K16.k == 2 * COPY_ELEMENTS  # a k step is two 16-byte chunks of a row
