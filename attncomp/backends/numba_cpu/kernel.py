"""Lowering an ``ac.tile_grid`` to a parallel Numba kernel.

One task per (batch position, query block) -- a unit; with grouped-query
attention, per (batch, key/value head, query block), the task handling the
``G`` query heads that share a key/value head together, so every key and
value tile is read from memory once and used ``G`` times.  The tasks run in
``NAME_task``, a plain ``@njit`` function each worker of the shared parallel
launch calls at its address (see :meth:`KernelWriter.write`):

    for each head g of the group: prologue, load its query tile, m = -inf, l = 0, acc = 0
    for kb in [first, end):                 # the union of the heads' loop bounds (from the IR)
        for each head g:
            tile_class = ...                # the IR's classification code, or its default
            skipped: nothing; otherwise
            s = q_tile @ k_tileᵀ            # BLAS gemm, keys read in place
            per row, vectorised over its keys: score(s), mask only when tile_class == 1, row max
            per row: keep m unless the max grew by more than 2**LAZY (then rescale l, acc)
            s = exp2(s - m), l += row sums
            acc += s @ v_tile               # BLAS gemm, accumulating in place
    out = acc / l, lse = (m + log2(l)) ln 2 # rows with no visible key: 0 and -inf

Scores and maxima are kept in base 2 (the score times log2(e); exp2 needs no multiply).
Where OpenBLAS multiplies small tiles by its small-matrix kernels (``score_layout``), a tile
holds its scores by keys instead, ``st = k_tile @ q_tileᵀ`` (the query tile transposed once per
task) and ``acc += stᵀ @ v_tile``, with the softmax run down the keys, vectorised over the rows.
Positions inside the loops are unclamped and gathers take unsigned indices
(``tiles.element_expr``, ``codegen.ScalarEmitter``): a bias read along a row's keys is one
vectorised run of memory.  A few query rows (decoding) use a row-major tile and
loops vectorised over the keys, which take the rows of all the heads of the group in one
pass over the key tile (``group_scores``, at the first head computing it) and over the
value tile (``group_values``, after the last): each element is read, and widened from
bf16, once per four rows (a bf16 GQA decode step 20% faster than row by row).  Tiles
read through a page table are multiplied in place too, a page's run of rows at a
time (``page_runs``); BLAS takes them gathered into a buffer.

When there are fewer units than threads (one token decoded for few heads),
each unit's key blocks are split into chunks computed in parallel, and a
second loop merges the chunks' (m, l, acc) by their log-sum-exp.

The score and mask functions are the ``ac.map`` regions of the IR written as
scalar code; loop bounds, head mapping and classification are the IR's own
scalar ops, recomputed per head where they are needed.  Work buffers are per
task and hold one tile per head of the group.
"""

from __future__ import annotations

from attncomp.backends.codegen import NUMPY_SCALAR, KernelSource, dim_expr, page_index, page_size
from attncomp.backends.key_splits import split_blocks, write_part_range, write_unit_parts
from attncomp.backends.lse_merge import MergeSpelling, write_finish, write_merge
from attncomp.backends.numba_cpu import score_layout
from attncomp.backends.numba_cpu import signatures as sig
from attncomp.backends.numba_cpu.intrinsics import blas_kernels
from attncomp.backends.numba_cpu.tile_math import LAZY
from attncomp.backends.numba_cpu.vector_loops import NUMBA_CODES, code_scale
from attncomp.backends.tiles import TileCompute, TiledAttention, element_expr
from attncomp.ir.core import Value
from attncomp.ir.dims import dim
from attncomp.ir.ops.shape import rows_before_heads
from attncomp.ir.types import accumulation_dtype

#: query rows up to which a task computes a tile row-major with loops (decoding a few tokens)
#: rather than by BLAS on the transposed tile; the generated module's ``FEW_ROWS``
FEW_ROWS = 4
#: multiply-adds (rows x keys x (D + E), summed over units) under which a call runs on the calling
#: thread: starting the parallel workers costs more than a few microseconds of work
SERIAL_WORK = 1 << 15


#: the scalar code's math functions that the shared tile code replaces (``tile_math``: float32
#: tanh, exp and log that vectorise, called by their own names so that they are inlined into the
#: loop; other types keep NumPy's)
FUNCTIONS = {
    "ac.tanh": "tanh",
    ("ac.tanh", "f32"): "tanh_f32",
    ("ac.exp", "f32"): "exp_f32",
    ("ac.log", "f32"): "log_f32",
}


class KernelWriter(KernelSource):
    """Writes one kernel function for one tiled attention."""

    functions = FUNCTIONS
    #: the loops run valid rows and keys alone, positions unclamped (``tiles.element_expr``), and
    #: gathers take unsigned indices: a bias read along a row's keys is one vectorised run of memory
    unsigned_gathers = True

    def __init__(
        self,
        name: str,
        tiled: TiledAttention,
        captured: dict[Value, str],
        dims: list[str],
        transposed: dict[Value, tuple[int, ...]] | None = None,
    ):
        super().__init__(captured, dims)
        self.name = name
        #: the accumulation type: float64 for float64 specs, float32 otherwise
        self.acc_dtype = accumulation_dtype(tiled.grid.results[0].type.dtype)
        self.acc = NUMPY_SCALAR[self.acc_dtype]
        self.t = tiled
        #: tile sources passed as bf16 bits: each element read is widened (``bf16_to_f32``)
        self.bits = sig.stored_bf16(tiled.grid)
        #: tile sources passed as 8-bit codes, each row with its scale (an 8-bit cache's views)
        self.codes = sig.stored_f8(tiled.grid)
        #: tile sources passed as the array before a transpose, by its permutation (``sig.transposes_in_place``)
        self.transposed = {v: p for v, p in (transposed or {}).items() if v in captured}
        repeat = tiled.grid.attrs.get("kv_repeat", 1)
        #: query heads per task: the group sharing a key/value head (head axis 1 of rank-4 outputs)
        self.group = dim_expr(dim(repeat)) if len(tiled.batch_args) == 2 else "1"
        #: key blocks per part of a batch-invariant grid's fixed key split (``key_splits``); None: the
        #: keys are split only when the units are too few for the threads
        self.split_blocks = split_blocks(tiled.grid, tiled.block_k)
        #: OpenBLAS's name for the kernels that multiply the tiles (``score_layout``)
        self.blas = blas_kernels()
        computes = [c for c in (tiled.masked, tiled.full) if c is not None]
        #: which ways the kernel's tile classes hold their scores: by keys (True), by rows (False)
        self.layouts = {self.holds_by_keys(c, masked) for c in computes for masked in (True, False)}

    def holds_by_keys(self, compute: TileCompute, with_mask: bool) -> bool:
        """Whether BLAS's tiles of ``compute`` (its mask evaluated or not) hold their scores by keys."""
        return score_layout.by_keys(self.blas, self.t.block_q, reads_along_keys(compute, with_mask))

    @property
    def slack(self) -> float:
        """How far a tile's max may pass a row's before the row is rescaled (``reference_max``): none
        where the kernel returns each row's max score (its max must be exact)."""
        return 0.0 if self.t.with_max else LAZY

    def params(self) -> list[str]:
        outs = [f"out_{k}" for k in range(len(self.t.grid.results))]
        return outs + list(self.captured.values()) + [f"d_{d}" for d in self.dims] + ["n_threads"]

    def param_types(self) -> list[str]:
        """Numba types of :meth:`params` (see ``signatures``)."""
        acc = self.acc_dtype
        outs = [sig.array_type(acc, r.type.rank) for r in self.t.grid.results]
        return outs + sig.captured_types(self.t.grid, self.captured, acc) + [sig.INT] * (len(self.dims) + 1)

    # pieces -------------------------------------------------------------------
    def batch_decode(self, rank: int) -> list[str]:
        """Task index -> batch indices (row-major, heads counted in groups) and the query block."""
        w = self.w
        w.line("qb = n_qb - 1 - unit % n_qb  # the last query blocks first: under a causal mask the largest")
        rest = "unit // n_qb"
        names = [f"bi_{k}" for k in range(rank)]
        for k in reversed(range(rank)):
            extent = "n_groups" if rank == 2 and k == 1 else f"out_0.shape[{k}]"
            w.line(f"rest_{k} = {rest}")
            w.line(f"{names[k]} = rest_{k} % {extent}")
            rest = f"rest_{k} // {extent}"
        return names

    def head(self) -> None:
        """Set the head index of group member ``g`` and run the grid's scalar prologue for it."""
        if len(self.t.batch_args) == 2:
            self.w.line("bi_1 = group * G + g")
        for op in self.t.prologue:
            self.scalar().op(op)

    def load_query(self) -> None:
        """Copy the query tile of head ``g``, by rows and transposed: its ``nq`` rows, all that the
        products and the softmax read (a decoding step copies one row, not a block)."""
        w = self.w
        load = self.t.q_load
        batch = [self.scalar().ref(v) for v in load.operands[1:-1]]
        w.line("for rr in range(nq):")
        with w.indent():
            w.line("for dd in range(n_d):")
            with w.indent():
                x = self.element(load, self.source_at(load.operands[0], [*batch, "i0 + rr", "dd"]))
                w.line(f"x = ACC({x})")
                w.line("qt[g, rr, dd] = x")
                if True in self.layouts:
                    w.line("qt_t[g, dd, rr] = x")

    def score(self, compute: TileCompute, with_mask: bool, i: str, j: str, at: str) -> None:
        """``xv`` = the score of element ``at`` (row ``i``, key ``j``) in base 2, -inf where masked."""
        w = self.w
        batch_vals = [self.scalar().ref(v) for v in compute.score.operands[:-3]]
        (x,) = self.scalar().block(compute.score.regions[0], batch_vals + [i, j, at])
        if with_mask and compute.mask is not None:
            mask_batch = [self.scalar().ref(v) for v in compute.mask.operands[:-2]]
            (visible,) = self.scalar().block(compute.mask.regions[0], mask_batch + [i, j])
            w.line(f"xv = ACC({x} * LOG2E) if {visible} else ACC(-np.inf)")
        else:
            w.line(f"xv = ACC({x} * LOG2E)")

    def row_index(self, compute: TileCompute) -> str:
        i = self.fresh("i")
        self.w.line(f"{i} = {element_expr(compute.score.operands[-3], self.names, 'r', '0', clamped=False)}")
        return i

    def key_index(self, compute: TileCompute) -> str:
        j = self.fresh("j")
        self.w.line(f"{j} = {element_expr(compute.score.operands[-2], self.names, '0', 'c', clamped=False)}")
        return j

    def scores_by_keys(self, compute: TileCompute, with_mask: bool) -> None:
        """Scores of the transposed tile ``st[c, r]`` and each row's max, vectorised over the rows."""
        w = self.w
        w.line("for r in range(nq):")
        with w.indent():
            w.line("mx[r] = ACC(-np.inf)")
        w.line("for c in range(nk):")
        with w.indent():
            j = self.key_index(compute)
            w.line("for r in range(nq):")
            with w.indent():
                self.score(compute, with_mask, self.row_index(compute), j, "st[c, r]")
                w.line("st[c, r] = xv")
                w.line("mx[r] = MAXIMUM(mx[r], xv)  # NaN-propagating, and vectorised")

    def scores_by_rows(self, compute: TileCompute, with_mask: bool, element: str = "sr[r, c]") -> None:
        """Scores of the row-major tile ``sr[r, c]`` (``element``: another such tile's) and each row's
        max, vectorised over the keys."""
        w = self.w
        w.line("for r in range(nq):")
        with w.indent():
            i = self.row_index(compute)
            w.line("row_max = ACC(-np.inf)")
            w.line("for c in range(nk):")
            with w.indent():
                self.score(compute, with_mask, i, self.key_index(compute), element)
                w.line(f"{element} = xv")
                w.line("row_max = MAXIMUM(row_max, xv)  # NaN-propagating, and vectorised")
            w.line("mx[r] = row_max")

    def weights(self, compute: TileCompute, by_rows: bool, element: str | None = None) -> None:
        """The probabilities times the weight region (attention dropout), after their row sums and
        before the values' product: ``st[c, r]`` by keys, ``sr[r, c]`` (or ``element``) row by row."""
        if compute.weight is None:
            return
        w = self.w
        batch = [self.scalar().ref(v) for v in compute.weight.operands[:-2]]
        outer, inner = ("r", "c") if by_rows else ("c", "r")
        w.line(f"for {outer} in range({'nq' if by_rows else 'nk'}):")
        with w.indent():
            first = self.row_index(compute) if by_rows else self.key_index(compute)
            w.line(f"for {inner} in range({'nk' if by_rows else 'nq'}):")
            with w.indent():
                second = self.key_index(compute) if by_rows else self.row_index(compute)
                i, j = (first, second) if by_rows else (second, first)
                (factor,) = self.scalar().block(compute.weight.regions[0], batch + [i, j])
                at = element or ("sr[r, c]" if by_rows else "st[c, r]")
                w.line(f"{at} = ACC({at} * {factor})")

    def key_tile(self, compute: TileCompute, mask_when: str | None) -> None:
        """One key tile for head ``g``: by BLAS, its scores held by rows or by keys (``score_layout``),
        or (a few query rows, decoding) by loops on row-major scores, each row vectorised over its keys.  The CPU writes
        one copy per tile class: ``mask_when`` is "True" (masked) or None (full)."""
        w = self.w
        with_mask = mask_when is not None
        for op in compute.scalar_ops:
            self.scalar().op(op)
        w.line(f"j0 = {self.scalar().ref(compute.k_load.operands[-1])}")
        w.line("nk = min(BK, n_keys - j0)")
        # Keys and values are read in place: C-contiguous rows, multiplied without a transpose.
        # bf16 rows in place are read as bits by the few-row loops (decoding streams half the
        # bytes) and widened into float32 buffers for BLAS.  Rows read through pages are read in
        # place by the few-row loops too, a page's run of rows at a time, and gathered into
        # float32 buffers for BLAS.  Rows of an array read through a transpose (FlashAttention's
        # [B, S, H, D]: a head's rows H * D apart) are multiplied in place by BLAS (its leading
        # dimension the rows' stride) and copied into the buffers for the few-row loops.
        loads = (("ks", compute.k_load), ("vs", compute.v_load))
        raw = {load: self.bits_in_place(load) for _, load in loads}
        # pages holding a row's heads together (FlashAttention's layout): copied too, a row at a time
        apart = {load: self.rows_apart(load) for _, load in loads}
        # rows a transpose apart that BLAS multiplies where they are: float32 or float64 (bf16 is widened)
        in_place = {load: self.blas_in_place(load) for _, load in loads}
        for name, load in loads:
            if raw[load]:
                w.line(f"{name}_bits = {self.tile_rows(load)}")
            elif not self.paged(load) and not apart[load]:
                self.load_rows(name, load, f"{name[0]}_staged")
        w.line("if nq > FEW_ROWS:")
        with w.indent():
            for name, load in loads:
                if raw[load] or self.paged(load) or (apart[load] and not in_place[load]):
                    self.load_rows(name, load, f"{name[0]}_staged")
                elif in_place[load]:
                    w.line(f"{name}_apart = {self.tile_rows(load)}")
            ks, vs = (f"{name}_apart" if in_place[load] else name for name, load in loads)
            if not self.holds_by_keys(compute, with_mask):
                w.line(f"gemm(0, 1, nq, nk, n_d, qt[g], {ks}, 0.0, srm)  # srm = q_tile @ ksᵀ")
                self.scores_by_rows(compute, with_mask, "srm[r, c]")
                w.line(f"softmax_by_rows(srm, nq, nk, m, l, acc, mx, m_safe, g, {self.slack})")
                self.weights(compute, by_rows=True, element="srm[r, c]")
                w.line(f"gemm(0, 0, nq, n_e, nk, srm, {vs}, 1.0, acc[g])  # acc += srm @ vs")
            else:
                w.line(f"gemm(0, 0, nk, nq, n_d, {ks}, qt_t[g], 0.0, st)  # st = ks @ q_tileᵀ")
                self.scores_by_keys(compute, with_mask)
                # per row: the reference max (rescaling l and acc when it grows), P = exp2(st - max), l += sums
                w.line(f"softmax_by_keys(st, nq, nk, m, l, acc, mx, m_safe, row_sum, g, {self.slack})")
                self.weights(compute, by_rows=False)
                w.line(f"gemm(1, 0, nq, n_e, nk, st, {vs}, 1.0, acc[g])  # acc += stᵀ @ vs")
        w.line("else:")
        with w.indent():
            for name, load in loads:
                if apart[load]:
                    self.load_rows(name, load, f"{name[0]}_staged")
            # the rows of the group's heads scored together at the first head computing this tile,
            # their values multiplied together after the last (task: group_values)
            w.line("if not scored:")
            with w.indent():
                if self.paged(compute.k_load):
                    factor = self.code_scale(compute.k_load) if compute.k_load.operands[0] in self.codes else None

                    def scores(rows: str, scales: str | None) -> list[str]:
                        lines = [f"group_scores(qt, qt_bits, qt_is_bf16, {rows}, sg, sg_spare, G, nq, run, 0, c0)"]
                        if scales is not None:  # products with codes: times each key's scale
                            lines.append(f"scale_keys(sg, {scales}, {factor}, G, nq, run, c0)")
                        return lines

                    self.page_runs(compute.k_load, "j0", "nk", scores)
                else:
                    # the rows nk on are prefetched, the next tile's (a hint: past the end it fetches nothing)
                    keys = "ks_bits" if raw[compute.k_load] else "ks"
                    w.line(f"group_scores(qt, qt_bits, qt_is_bf16, {keys}, sg, sg_spare, G, nq, nk, nk, 0)")
                    if compute.k_load.operands[0] in self.codes:  # products with codes: times each key's scale
                        scales = self.tile_rows(compute.k_load, scales=True)
                        w.line(f"scale_keys(sg, {scales}, {self.code_scale(compute.k_load)}, G, nq, nk, 0)")
                w.line("scored = True")
            w.line("sr = sg[g]")
            self.scores_by_rows(compute, with_mask)
            w.line(f"softmax_by_rows(sr, nq, nk, m, l, acc, mx, m_safe, g, {self.slack})")
            self.weights(compute, by_rows=True)
            w.line("active[g] = 1")
            if self.paged(compute.v_load):  # where the values' pages are read from, after the heads
                for name, v in zip(self.group_value_at(compute.v_load), compute.v_load.operands[1:-1]):
                    w.line(f"{name} = {self.scalar().ref(v)}")
                w.line("j0_group = j0")
            else:
                w.line(f"vs_group = {'vs_bits' if raw[compute.v_load] else 'vs'}")
                if compute.v_load.operands[0] in self.codes:
                    w.line(f"vs_scale_group = {self.tile_rows(compute.v_load, scales=True)}")
            w.line("nk_group = nk")

    def page_runs(self, load_op, start: str, count: str, call, at: list[str] | None = None) -> None:
        """Rows ``start .. start + count`` of a tile read through pages, in place, a page's run of rows
        at a time: ``call(rows, scales)`` gives the lines that use them (``rows``: a view of the pool,
        ``scales``: of 8-bit pages' row scales, else None; ``c0`` the run's first row in the tile,
        ``run`` its rows).  ``at``: names holding the load's batch and head indices, where they are
        not its operands' own."""
        w = self.w
        view = self.page_view(load_op)
        pages, table = self.array_ref(load_op.operands[0]), self.array_ref(view.operands[1])
        source = load_op.operands[0]
        scales = self.array_ref(sig.quantized_scales(source)) if source in self.codes else None
        batch, *heads = at or [self.scalar().ref(v) for v in load_op.operands[1:-1]]
        entry = f"{batch}, " if view.operands[1].type.rank == 2 else ""
        size = page_size(pages, view)
        w.line("c0 = np.int64(0)")
        w.line(f"while c0 < {count}:  # the rows on one page: a contiguous run")
        with w.indent():
            w.line(f"at = {start} + c0")
            w.line(f"page = {table}[{entry}at // {size}]")
            w.line(f"slot = at % {size}")
            w.line(f"run = min({count} - c0, {size} - slot)")
            # the next page's rows (this tile's next run, or the next tile's first), fetched while this
            # run is multiplied: a page's rows are a few KB, where the CPU's prefetcher starts cold
            w.line("if at + run < n_keys:")
            with w.indent():
                next_page = f"{table}[{entry}(at + run) // {size}]"
                w.line(f"prefetch_rows({pages}[{next_page}, {page_index(view, heads, '0:BK')}])")
            run = page_index(view, heads, "slot:slot + run").removesuffix(", ")
            run_scales = None if scales is None else f"{scales}[page, {run}]"
            for line in call(f"{pages}[page, {run}]", run_scales):
                w.line(line)
            w.line("c0 += run")

    def group_value_at(self, v_load) -> list[str]:
        """The names holding the batch and head indices of a paged value tile, set by the heads that
        compute it and read by the group's values pass after them."""
        return [f"v_at_{k}" for k in range(len(v_load.operands) - 2)]

    def element(self, load_op, expr: str) -> str:
        """An element ``expr`` read from ``load_op``'s source, as a float (bf16 bits widened)."""
        return f"bf16_to_f32({expr})" if load_op.operands[0] in self.bits else expr

    def code_scale(self, load_op) -> str:
        """What an 8-bit source's decoded codes are multiplied by, besides their rows' scales
        (``vector_loops.code_scale``), as a float32 literal."""
        codes = sig.quantized_cache(load_op.operands[0]).operands[0].type.dtype
        return f"np.float32({code_scale(NUMBA_CODES[codes])!r})"

    def paged(self, load_op) -> bool:
        """Whether the few-row loops read a key or value tile in place through a page table, a page's
        run of rows at a time (pages whose head's rows are together: ``[num_pages, *heads, P, d]``)."""
        view = self.page_view(load_op)
        return view is not None and not self.rows_apart_in_pages(load_op)

    def rows_apart_in_pages(self, load_op) -> bool:
        """Whether a key or value tile is read through pages that keep a row's heads together
        (``slot = 1``, ``[num_pages, P, *heads, d]``): a head's rows a row of heads apart, copied into
        the work buffers for every product."""
        view = self.page_view(load_op)
        return view is not None and rows_before_heads(view)

    def blas_in_place(self, load_op) -> bool:
        """Whether BLAS multiplies a key or value tile's rows where they are, a transpose apart (float32
        or float64: bf16 is widened)."""
        return load_op.operands[0] in self.transposed and load_op.operands[0] not in self.bits

    def rows_apart(self, load_op) -> bool:
        """Whether a key or value tile's rows are not together (read through a transpose, or pages
        keeping a row's heads together): the few-row loops read them from the work buffers."""
        return load_op.operands[0] in self.transposed or self.rows_apart_in_pages(load_op)

    def bits_in_place(self, load_op) -> bool:
        """Whether a key or value tile's rows are bf16 bits or 8-bit codes the few-row loops read in
        place (not through pages)."""
        source = load_op.operands[0]
        in_place = source in self.bits or source in self.codes
        return self.page_view(load_op) is None and in_place and source not in self.transposed

    def staged(self, load_op) -> bool:
        """Whether a key or value tile is copied into a work buffer for BLAS (read through pages,
        widened from bf16, or dequantised from 8-bit codes); the few-row loops read each kind in place."""
        source = load_op.operands[0]
        paged = self.page_view(load_op) is not None
        return paged or source in self.bits or source in self.codes or source in self.transposed

    def load_rows(self, target: str, load_op, buffer: str) -> None:
        """``target`` = the tile's rows: in place, or copied into ``buffer``: page by page through the
        table, and widened from bf16."""
        if not self.staged(load_op):
            self.w.line(f"{target} = {self.tile_rows(load_op)}")
            return
        view = self.page_view(load_op)
        src = self.array_ref(load_op.operands[0])
        if load_op.operands[0] in self.codes and view is not None:  # 8-bit pages: a page's run at a time
            scales = self.array_ref(sig.quantized_scales(load_op.operands[0]))
            page, _ = self.page_row(load_op, view, "j0 + c0")
            size = page_size(src, view)
            run = page_index(view, [self.scalar().ref(v) for v in load_op.operands[2:-1]], "slot:slot + run")
            run = run.removesuffix(", ")
            lines = [
                "c0 = np.int64(0)",
                "while c0 < nk:  # the rows on one page, each times its scale",
                f"    page = {page}",
                f"    slot = (j0 + c0) % {size}",
                f"    run = min(nk - c0, {size} - slot)",
                f"    dequantize_rows({src}[page, {run}], {scales}[page, {run}], "
                f"{self.code_scale(load_op)}, {buffer}[c0:], run)",
                "    c0 += run",
            ]
        elif load_op.operands[0] in self.transposed:  # rows a transpose apart: copied, each a contiguous run
            batch = [self.scalar().ref(v) for v in load_op.operands[1:-1]]
            element = self.element(load_op, self.source_at(load_op.operands[0], [*batch, "j0 + c", "e"]))
            lines = ["for c in range(nk):", f"    for e in range({buffer}.shape[1]):"]
            lines.append(f"        {buffer}[c, e] = {element}")  # element by element: vectorised
        elif load_op.operands[0] in self.codes:  # 8-bit codes: each row times its scale
            rows, scales = self.tile_rows(load_op), self.tile_rows(load_op, scales=True)
            lines = [f"dequantize_rows({rows}, {scales}, {self.code_scale(load_op)}, {buffer}, nk)"]
        elif view is None:  # bf16 rows: each row's bits to the top half of the buffer's float32 bits
            batch = "".join(f"{self.scalar().ref(v)}, " for v in load_op.operands[1:-1])
            lines = [
                "for c in range(nk):",
                f"    row = {src}[{batch}j0 + c]",
                f"    wide = {buffer}_bits[c]",
                "    for e in range(row.shape[0]):  # vectorised: a widening and a shift",
                "        wide[e] = np.uint32(row[e]) << np.uint32(16)",
            ]
        else:
            page, at = self.page_row(load_op, view, "j0 + c")
            lines = [
                "for c in range(nk):  # row j0 + c: its page from the table, its slot in the page",
                f"    page = {page}",
                f"    for e in range({buffer}.shape[1]):",
                f"        {buffer}[c, e] = {self.element(load_op, f'{src}[page, {at}e]')}",
            ]
        # the heads of a group share the key/value head: a tile is staged once per key block
        lines = [f"if {buffer}_at != kb:", *(f"    {line}" for line in lines), f"    {buffer}_at = kb"]
        lines.append(f"{target} = {buffer}[:nk]")
        for line in lines:
            self.w.line(line)

    def no_rows(self, load_op, scales: bool = False) -> str:
        """No rows of a value tile read in place, of the type the few-row branch gives its rows
        (``scales``: of an 8-bit source's row scales)."""
        source = load_op.operands[0]
        if self.rows_apart(load_op):  # its rows come from the work buffer
            return "v_staged[0:0]"
        src = self.array_ref(sig.quantized_scales(source) if scales else source)
        return f"{src}[{''.join('0, ' for _ in load_op.operands[1:-1])}0:0]"

    def tile_rows(self, load_op, scales: bool = False) -> str:
        """``src[batch..., j0:j0 + nk]`` for a key or value tile load (``scales``: of an 8-bit
        source's row scales)."""
        source = load_op.operands[0]
        batch = [self.scalar().ref(v) for v in load_op.operands[1:-1]]
        if source in self.transposed:
            return self.source_at(source, [*batch, "j0:j0 + nk", ":"])
        src = self.array_ref(sig.quantized_scales(source) if scales else source)
        return f"{src}[{''.join(b + ', ' for b in batch)}j0:j0 + nk]"

    def source_at(self, source: Value, index: list[str]) -> str:
        """``source[index]``: the array passed for it indexed in its own order, where it is the array
        before a transpose (``index[k]`` of axis ``k`` of the transposed value is the passed array's
        axis ``perm[k]``)."""
        perm = self.transposed.get(source)
        return f"{self.array_ref(source)}[{', '.join(index if perm is None else sig.permuted(index, perm))}]"

    # the kernel ---------------------------------------------------------------
    def header(self) -> None:
        """The constants and sizes each of the kernel's functions starts with."""
        t, w = self.t, self.w
        nb = len(t.batch_args)
        q_src = self.array_ref(t.q_load.operands[0])
        v_src = self.array_ref(t.masked.v_load.operands[0])
        w.line(f"ACC = {self.acc}")
        w.line(f"EXP2 = {'exp2_f32' if self.acc == 'np.float32' else 'np.exp2'}")
        w.line("LOG2E = ACC(1.4426950408889634)  # scores and maxima are kept in base 2")
        w.line("LN2 = ACC(0.6931471805599453)")
        w.line(f"MAXIMUM = {'maximum_f32' if self.acc == 'np.float32' else 'maximum_f64'}")
        w.line(f"BQ = {t.block_q}")
        w.line(f"BK = {t.block_k}")
        w.line(f"G = {self.group}")
        w.line("MAX_SPLIT = 16")
        w.line(f"n_rows = out_0.shape[{nb}]")
        # the keys' length from the IR's type: a decoder's cache buffer is longer than what it holds
        w.line(f"n_keys = {dim_expr(t.masked.k_load.operands[0].type.shape[-2])}")
        w.line(f"n_d = {q_src}.shape[{t.q_load.operands[0].type.rank - 1}]")
        w.line(f"n_e = {v_src}.shape[{t.masked.v_load.operands[0].type.rank - 1}]")
        w.line("n_qb = (n_rows + BQ - 1) // BQ")
        if nb == 2:
            w.line("n_groups = out_0.shape[1] // G")
        w.line("n_units = n_qb" + "".join(f" * out_0.shape[{k}]" for k in range(nb)) + " // G")

    def write(self, jit: sig.Jit) -> str:
        """Two functions: ``NAME_task`` (a worker's share of the tasks: a unit's query block, or a
        split of its keys; or with ``merging``, of the split units' merges) and ``NAME``, the
        driver, which runs it on the workers through the shared parallel launch
        (``launch.launch``).  The task is a plain ``@njit`` function of ``launch.TASK``'s
        signature, called through a pointer with its arguments packed (``launch.pack_address``),
        so neither its code nor a parallel loop is compiled with the driver."""
        w = self.w
        nb = len(self.t.batch_args)
        params = ", ".join(self.params())
        shared = f"{params}, n_split, part_m, part_l, part_acc, tickets"
        acc = self.acc_dtype
        parts = [
            sig.INT,
            sig.array_type(acc, 3),
            sig.array_type(acc, 3),
            sig.array_type(acc, 4),
            sig.array_type("i64", 1),
        ]
        arg_types = [*self.param_types(), *parts]
        with sig.packed_task(w, jit, self.name, f"{self.name}_task", "worker", shared, arg_types) as pack:
            self.header()
            w.line("if merging:  # a split unit's partial results merged")
            with w.indent():
                w.line("for unit in range(worker, n_units, n_workers):")
                with w.indent():
                    self.unit_start(nb)
                    if self.split_blocks is not None:  # a unit's own parts, from its own key range
                        self.unit_bounds(load=False)
                        write_unit_parts(w, "first", "end", self.split_blocks)
                        w.line("if own_parts <= 1:  # finished by its one part")
                        with w.indent():
                            w.line("continue")
                    self.merge(nb)
                w.line("return")
            self.task()
        w.line(str(jit.typed(f"types.void(types.intp, {', '.join(self.param_types())})")))
        w.line(f"def {self.name}(task_at, {params}):")
        with w.indent():
            self.header()
            w.line("blas_threads = pin_blas_threads()  # the tasks' BLAS calls run on their own thread")
            # Too few units to fill the cores (decoding one token for few heads): split each
            # unit's keys into chunks done in parallel, merged by their log-sum-exp (flash-decoding).
            w.line("n_split = 1")
            w.line("if n_units * min(n_rows, BQ) * n_keys * (n_d + n_e) < SERIAL_WORK:")
            with w.indent():
                w.line("n_threads = 1  # a small call: no parallel launch")
            if self.split_blocks is not None:  # batch-invariant: parts at fixed key positions, whatever the launch
                blocks = self.split_blocks
                w.line(f"n_split = max(1, ((n_keys + BK - 1) // BK + {blocks - 1}) // {blocks})")
            else:
                w.line("if 0 < n_units < n_threads:")
                with w.indent():
                    w.line("n_split = min(MAX_SPLIT, (2 * n_threads + n_units - 1) // n_units)")
            w.line("n_parts = n_units * n_split if n_split > 1 else 0")
            w.line("part_m = np.empty((n_parts, G, BQ), dtype=ACC)")
            w.line("part_l = np.empty((n_parts, G, BQ), dtype=ACC)")
            w.line("part_acc = np.empty((n_parts, G, BQ, n_e), dtype=ACC)")
            w.line("tickets = np.zeros(1, dtype=np.int64)  # the tasks' counter: take_ticket")
            sig.write_pack(w, pack, shared)
            # one worker per thread, each taking the next task free (``take_ticket``) when done with one
            w.line("n_workers = min(n_units * n_split, n_threads)")
            w.line("if n_workers == 1:")
            with w.indent():
                w.line("call_task(task_at, np.int64(0), np.int64(1), np.int64(0), pack_at)")
            w.line("else:")
            with w.indent():
                w.line("launch(task_at, n_workers, pack_at)")
            # fewer units than threads: their merges are a few rows each, done here (a second
            # parallel launch would not pay for itself)
            w.line("if n_split > 1:")
            with w.indent():
                w.line("call_task(task_at, np.int64(0), np.int64(1), np.int64(1), pack_at)")
            w.line("keep_alive(pack)  # the arrays the tasks read, held until they are done")
            w.line("restore_blas_threads(blas_threads)")
        sig.declare_addresses(w, self.name, [f"{self.name}_task"])
        return w.text()

    def task(self) -> None:
        """A worker's tasks: for each, its unit's query tile, its key blocks, its result or partial
        result.  Work buffers are allocated once per worker."""
        t, w = self.t, self.w
        nb = len(t.batch_args)
        w.line("qt = np.empty((G, BQ, n_d), dtype=ACC)")
        if True in self.layouts:  # the query tile transposed, and the scores by keys
            w.line("qt_t = np.empty((G, n_d, BQ), dtype=ACC)")
            w.line("st = np.empty((BK, BQ), dtype=ACC)")
        if False in self.layouts:  # the scores by rows
            w.line("srm = np.empty((BQ, BK), dtype=ACC)")
        w.line("sr = np.empty((FEW_ROWS, BK), dtype=ACC)")
        w.line("m = np.empty((G, BQ), dtype=ACC)")
        w.line("l = np.empty((G, BQ), dtype=ACC)")
        for row in ("mx", "m_safe", "row_sum"):
            w.line(f"{row} = np.empty(BQ, dtype=ACC)")
        w.line("acc = np.empty((G, BQ, n_e), dtype=ACC)")
        # a few rows: the scores of the group's rows, and which heads computed the key tile
        w.line("sg = np.empty((G, FEW_ROWS, BK), dtype=ACC)")
        w.line("sg_spare = np.empty(BK, dtype=ACC)  # group_scores' rows past the group's, to a multiple of four")
        w.line("active = np.zeros(G, dtype=np.int64)")
        w.line("row_ids = np.empty(G * FEW_ROWS, dtype=np.int64)  # group_values' work space")
        # the group's query rows as bf16 bits, for the CPU's bf16 dot products with bf16 keys
        w.line("qt_bits = np.empty(((G * FEW_ROWS + 3) // 4 * 4, n_d), dtype=np.uint16)")
        # key and value tiles gathered from pages, or widened (either may be: a bf16 v with an f32 k)
        staged = self.staged(t.masked.k_load) or self.staged(t.masked.v_load)
        if staged:
            w.line("k_staged = np.empty((BK, n_d), dtype=ACC)")
            w.line("v_staged = np.empty((BK, n_e), dtype=ACC)")
            if t.masked.k_load.operands[0] in self.bits or t.masked.v_load.operands[0] in self.bits:
                w.line("k_staged_bits = k_staged.view(np.uint32)  # bf16 widens into the float32 bits")
                w.line("v_staged_bits = v_staged.view(np.uint32)")
        # tasks taken one at a time, whichever worker is free: under a causal mask a unit's work grows
        # with its query block, and every n-th task per worker left one worker the larger half
        w.line("n_tasks = n_units * n_split")
        w.line("for _ in range(n_tasks):")
        with w.indent():
            w.line("task = take_ticket(tickets)")
            w.line("if task >= n_tasks:")
            w.line("    break")
            w.line("unit = task % n_units")
            w.line("split = task // n_units")
            self.unit_start(nb)
            # a batch-invariant part outside the unit's keys returns before it loads anything
            self.unit_bounds(load=self.split_blocks is None)
            if self.split_blocks is not None:  # this part's key blocks, at fixed positions
                write_part_range(w, "first", "end", "split", self.split_blocks)
                w.line("if not (stores_part or finishes):  # a part outside the unit's keys")
                with w.indent():
                    w.line("continue")
                w.line("for g in range(G):")
                with w.indent():
                    self.head()
                    self.load_query()
            if staged:  # no key block staged yet for this unit
                w.line("k_staged_at = np.int64(-1)")
                w.line("v_staged_at = np.int64(-1)")
            w.line("m[:, :nq] = -np.inf")
            w.line("l[:, :nq] = ACC(0.0)")
            w.line("acc[:, :nq] = ACC(0.0)")
            # the rows as bf16 bits once per task (not per key tile), where the keys are bf16 bits or codes
            keys = t.masked.k_load.operands[0]
            as_bits = (keys in self.bits and not self.rows_apart(t.masked.k_load)) or keys in self.codes
            bits = "query_bits(qt, qt_bits, G, nq)" if as_bits else "False"
            w.line(f"qt_is_bf16 = nq <= FEW_ROWS and {bits}")
            if self.split_blocks is None:
                w.line("if n_split > 1:")
                with w.indent():
                    w.line("chunk = (max(end - first, 0) + n_split - 1) // n_split")
                    w.line("first = first + split * chunk")
                    w.line("end = min(end, first + chunk)")
            v_load = t.masked.v_load
            if self.paged(v_load):  # where the values of the heads' key tile are: its first row and indices
                w.line("j0_group = np.int64(0)")
                for name in self.group_value_at(v_load):
                    w.line(f"{name} = np.int64(0)")
            else:
                w.line(f"vs_group = {self.no_rows(v_load)}  # the values of the heads' key tile")
                if v_load.operands[0] in self.codes:
                    w.line(f"vs_scale_group = {self.no_rows(v_load, scales=True)}  # and their rows' scales")
            w.line("nk_group = np.int64(0)")
            w.line("for kb in range(first, end):")
            with w.indent():
                self.names[t.loop.regions[0].args[0]] = "kb"
                w.line("scored = False")
                w.line("active[:] = 0")
                w.line("for g in range(G):")
                with w.indent():
                    self.head()
                    lo, hi = (self.scalar().ref(v) for v in t.loop.operands[:2])
                    w.line(f"if kb < {lo} or kb >= {hi}:")
                    with w.indent():
                        w.line("continue")
                    self.loop_body()
                w.line("if nq <= FEW_ROWS and scored:")
                # a bf16 output: 8-bit values may meet weights rounded to bf16 (``tile_math.group_values``)
                bf16_out = self.t.grid.results[0].type.dtype == "bf16"
                with w.indent():
                    if self.paged(v_load):
                        factor = self.code_scale(v_load) if v_load.operands[0] in self.codes else None

                        def values(rows: str, scales: str | None) -> list[str]:
                            lines = [f"group_values(sg, {rows}, acc, active, row_ids, G, nq, run, 0, c0, {bf16_out})"]
                            if scales is not None:  # weights times each value row's scale, first
                                lines.insert(0, f"scale_keys(sg, {scales}, {factor}, G, nq, run, c0)")
                            return lines

                        self.page_runs(v_load, "j0_group", "nk_group", values, self.group_value_at(v_load))
                    else:  # the rows nk_group on prefetched: the next tile's
                        if v_load.operands[0] in self.codes:  # weights times each value row's scale
                            w.line(f"scale_keys(sg, vs_scale_group, {self.code_scale(v_load)}, G, nq, nk_group, 0)")
                        tile = "nk_group, nk_group, 0"  # keys, prefetched rows ahead, first weight
                        w.line(f"group_values(sg, vs_group, acc, active, row_ids, G, nq, {tile}, {bf16_out})")
            w.line("if finishes:" if self.split_blocks is not None else "if n_split == 1:")
            with w.indent():
                w.line("for g in range(G):")
                with w.indent():
                    if nb == 2:
                        w.line("bi_1 = group * G + g")
                    self.finish()
            w.line("else:")
            with w.indent():
                w.line("part = unit * n_split + split")
                w.line("for g in range(G):")
                with w.indent():
                    w.line("for r in range(nq):")
                    with w.indent():
                        w.line("part_m[part, g, r] = m[g, r]")
                        w.line("part_l[part, g, r] = l[g, r]")
                        w.line("for e in range(n_e):")
                        with w.indent():
                            w.line("part_acc[part, g, r, e] = acc[g, r, e]")

    def unit_bounds(self, load: bool) -> None:
        """``[first, end)``: the union of the group's heads' key blocks (the IR's loop bounds); with
        ``load``, each head's query tile loaded on the way."""
        w, t = self.w, self.t
        w.line("first = np.int64(1) << 62")
        w.line("end = np.int64(0)")
        w.line("for g in range(G):")
        with w.indent():
            self.head()
            if load:
                self.load_query()
            lo, hi = (self.scalar().ref(v) for v in t.loop.operands[:2])
            w.line(f"first = min(first, {lo})")
            w.line(f"end = max(end, {hi})")

    def unit_start(self, nb: int) -> None:
        """Decode ``unit`` into batch indices and the query block; bind the grid's arguments."""
        w, t = self.w, self.t
        batch = self.batch_decode(nb)
        if nb == 2:
            w.line("group = bi_1")
        for arg, name in zip(t.batch_args, batch):
            self.names[arg] = name
        w.line("i0 = qb * BQ")
        self.names[t.i0] = "i0"
        w.line("nq = min(BQ, n_rows - i0)")

    def merge(self, nb: int) -> None:
        """Combine the splits' partial (m, l, acc) of one unit by their log-sum-exp."""
        w, t = self.w, self.t
        prefix = "".join(f"{self.names[a]}, " for a in t.batch_args)
        w.line("base = unit * n_split")
        w.line("for g in range(G):")
        with w.indent():
            if nb == 2:
                w.line("bi_1 = group * G + g")
            w.line("for r in range(nq):")
            with w.indent():
                own = self.split_blocks is not None  # only the unit's own parts
                spelling = MergeSpelling(
                    count="own_first + own_parts" if own else "n_split",
                    first="own_first" if own else None,
                    m="part_m[base + {s}, g, r]",
                    l="part_l[base + {s}, g, r]",
                    o="part_acc[base + {s}, g, r, {e}]",
                    out=f"out_0[{prefix}i0 + r, {{e}}]",
                    **self.t.row_stores(f"{prefix}i0 + r"),
                    weight="EXP2(ACC({m} - top_safe))",  # maxima are kept in base 2
                    to_natural=" * LN2",
                    features="n_e",
                )
                write_merge(w, spelling)

    def loop_body(self) -> None:
        self.by_tile_class(self.t, self.key_tile)

    def finish(self) -> None:
        t, w = self.t, self.w
        prefix = "".join(f"{self.names[a]}, " for a in t.batch_args)

        def outputs(denominator: str) -> None:
            w.line("for e in range(n_e):")
            with w.indent():
                w.line(f"out_0[{prefix}i0 + r, e] = acc[g, r, e] / {denominator}")

        w.line("for r in range(nq):")
        with w.indent():
            write_finish(w, "m[g, r]", "l[g, r]", outputs, **self.t.row_stores(f"{prefix}i0 + r"), to_natural=" * LN2")


def write_kernel(
    name: str,
    tiled: TiledAttention,
    captured: dict[Value, str],
    dims: list[str],
    jit: sig.Jit,
    transposed: dict[Value, tuple[int, ...]] | None = None,
) -> str:
    return KernelWriter(name, tiled, captured, dims, transposed).write(jit)


def reads_along_keys(compute: TileCompute, with_mask: bool) -> bool:
    """Whether the scores (or the mask, where evaluated) gather a captured tensor at a row's keys: its
    last index the key position, another the row's (``bias[b, h, i, j]``)."""
    regions = [compute.score.regions[0]]
    if with_mask and compute.mask is not None:
        regions.append(compute.mask.regions[0])
    for region in regions:
        n = len(region.args) - (1 if region is compute.score.regions[0] else 0)  # the score's last is the product
        row, key = region.args[n - 2], region.args[n - 1]
        for op in region.ops:
            if op.name == "ac.gather" and op.operands[-1] is key and row in op.operands[1:-1]:
                return True
    return False
