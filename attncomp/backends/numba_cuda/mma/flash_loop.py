"""The key loop of the asynchronous-copy tensor-core forward (``mma/flash_kernel.py``).

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
        online softmax; O += P V(i)     # overlaps K(i + 1)'s copy (P times the weight region: dropout)

Whole chunks of full tiles (class 2: no mask) run in a loop of their own, the main loop, as
FlashAttention-2 runs its unmasked iterations: at the start of a run the tiles ahead are classified
once to find where it ends (a tile that is masked or skipped, or the last whole chunk before the
keys' end), and the chunk after it; each iteration then has no mask, no keys past the end and no
classification, and copies the next chunk's keys without a check.  Where the score region is
``s * c`` with ``c`` never negative (``ir/signs.py``: ``D ** -0.5``), the main loop leaves the
products unscaled: the row's max is of the products, then scaled (``max(c s) = c max(s)``), and
``c log2 e`` is the multiplier of the exponent's one multiply-add.  Every other chunk (masked
tiles, the tail, a grid without full tiles) runs the general body above.

A launch of one key split (its thread blocks fill the GPU, as a long prefill's) runs a kernel
without the split range, the partial states and the merge (``KernelChoice.key_splits``).
"""

from __future__ import annotations

from attncomp.backends.numba_cuda.lanes import quotient
from attncomp.ir.core import Op, Value
from attncomp.ir.ops.tile import FULL
from attncomp.ir.signs import nonnegative


class FlashKeyLoop:
    """The chunks a ``FlashKernelWriter`` computes and the copies in flight around them (its plan
    ``mp``, tiles ``t``, ``copies``, ``scores`` and products are the writer's)."""

    def classify(self, var: str, cls: str) -> None:
        """The class of key block ``var`` into ``cls`` (the IR's classification code)."""
        t = self.t
        loop_arg = t.loop.regions[0].args[0]
        self.names[loop_arg] = var
        for op in t.classify_ops:
            self.scalar().op(op)
        self.w.line(f"{cls} = np.int32({self.scalar().ref(t.tile_class)})")
        self.names[loop_arg] = "kb"

    def next_computed(self, var: str, cls: str) -> None:
        """Advance ``var`` (a key block) to the first computed tile at or after it (``kb_top`` if
        none), its class into ``cls``; without a classification, every tile is computed."""
        t, w = self.t, self.w
        if t.tile_class is None:
            w.line(f"{cls} = np.int32({t.default_class})")
            return
        w.line(f"{cls} = np.int32(0)")
        w.line(f"while {var} < kb_top:")
        with w.indent():
            self.classify(var, cls)
            w.line(f"if {cls} != 0:")
            with w.indent():
                w.line("break")
            w.line(f"{var} = np.int32({var} + 1)")

    @property
    def scale(self) -> Value | None:
        """The factor ``c`` of a score region that is ``s * c`` with ``c`` never negative and the
        same for every element (``ir/signs.py``): the main loop folds it into the softmax."""
        region = self.t.masked.score.regions[0]
        *_, s = region.args
        if [op.name for op in region.ops] != ["ac.mul", "ac.yield"]:
            return None
        mul, done = region.ops
        factors = [x for x in mul.operands if x is not s]
        if done.operands[0] is not mul.results[0] or len(factors) != 1:
            return None  # not s * c (s * s has no factor)
        (c,) = factors
        # made outside the region (the same for every element), a scalar, never negative
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
            w.line(f"scale = ACC({self.ref(self.scale)})  # the scores' scale: the rows' maxima scaled by it")
            w.line("scale_log2 = scale * LOG2E  # and folded into the exponents")
        w.line("# the first chunk to compute, its keys in flight")
        w.line("kb = np.int32(kb_lo)")
        w.line("kb_top = np.int32(kb_hi)")
        self.next_computed("kb", "cls")
        w.line("c0 = np.int32(0)")
        w.line("if kb < kb_top:")
        with w.indent():
            self.copies("k", p.head_dim, f"kb * {p.block_k}")
        w.line("while kb < kb_top:")
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
        w.line("rk = np.int32(kb + 1)  # the run: full tiles from kb")
        if t.tile_class is not None:
            w.line("while rk < kb_top:")
            with w.indent():
                self.classify("rk", "rcls")
                w.line(f"if rcls != {FULL}:")
                with w.indent():
                    w.line("break")
                w.line("rk = np.int32(rk + 1)")
        else:
            w.line("rk = kb_top")
        w.line(f"run_end = np.int32(min(rk * {p.block_k}, n_keys // {p.chunk} * {p.chunk}))  # whole chunks only")
        w.line("# the chunk after the run: the rest of its last tile (keys past the end), else the next computed tile")
        w.line(f"if run_end < rk * {p.block_k}:")
        with w.indent():
            w.line(f"akb = np.int32({quotient('run_end', p.block_k)})")
            w.line(f"ac0 = np.int32(run_end - akb * {p.block_k})")
            w.line(f"acls = np.int32({FULL})")
        w.line("else:")
        with w.indent():
            w.line("akb = rk")
            w.line("ac0 = np.int32(0)")
            self.next_computed("akb", "acls")
        w.line("while True:  # the main loop")
        with w.indent():
            for op in compute.scalar_ops:
                self.scalar().op(op)
            j0 = self.ref(compute.k_load.operands[-1])
            w.line(f"jc = np.int32({j0} + c0)")
            self.chunk_start("jc", full=True)
            self.scores(compute, None, hoisted, full=True)
            w.line(f"c0 = np.int32(c0 + {p.chunk})")
            w.line(f"if c0 == {p.block_k}:")
            with w.indent():
                w.line("kb = np.int32(kb + 1)")
                w.line("c0 = np.int32(0)")
            w.line(f"more = jc + {p.chunk} < run_end")
            w.line("cp_async_wait(0)")
            w.line("cuda.syncthreads()  # V seen by every warp; every warp done with K")
            w.line("if more:")
            with w.indent():
                self.copies("k", p.head_dim, f"jc + {p.chunk}", full=True)
            self.chunk_end(hoisted, "scale" if self.scale is not None else None)
            w.line("if not more:")
            with w.indent():
                w.line("break")
        w.line("# K of the chunk after the run (every warp is past the barrier after its last use of K)")
        w.line("if akb < kb_top:")
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

    def chunk_end(self, hoisted: dict[Op, list[Op]], scale: str | None = None) -> None:
        """The online softmax (``scale``: folded into it), P times the weight region (dropout), and
        O += P V(i)."""
        self.softmax_update(scale)
        self.weigh(self.t.masked, hoisted)
        self.w.line("# O += P V")
        self.value_products()

    def general_chunk(self, hoisted: dict[Op, list[Op]]) -> None:
        """One chunk of any computed tile: the mask where the tile's class says, keys past the end
        hidden; then the next chunk: of this tile, else the next computed tile."""
        p, w, t = self.mp, self.w, self.t
        compute = t.masked
        for op in compute.scalar_ops:
            self.scalar().op(op)
        w.line(f"jc = np.int32({self.ref(compute.k_load.operands[-1])} + c0)")
        self.chunk_start("jc")
        masked = None if compute.mask is None else "cls == 1"
        if t.tile_class is None:
            masked = "True" if t.default_class == 1 and compute.mask is not None else None
        self.scores(compute, masked, hoisted)
        w.line("# the next chunk: of this tile, else the next computed tile")
        inside = f"(c0 + {p.chunk} < {p.block_k}) & (jc + {p.chunk} < n_keys)"
        w.line(f"nkb = select({inside}, kb, np.int32(kb + 1))")
        w.line(f"nc0 = select(nkb == kb, np.int32(c0 + {p.chunk}), np.int32(0))")
        w.line("ncls = cls")
        w.line("if nkb != kb:")
        with w.indent():
            self.next_computed("nkb", "ncls")
        w.line("cp_async_wait(0)")
        w.line("cuda.syncthreads()  # V seen by every warp; every warp done with K")
        w.line("if nkb < kb_top:")
        with w.indent():
            self.copies("k", p.head_dim, f"nkb * {p.block_k} + nc0")
        self.chunk_end(hoisted)
        w.line("kb = nkb")
        w.line("c0 = nc0")
        w.line("cls = ncls")
