"""Lowering an ``ac.key_grid`` (the tiled backward) to a parallel Numba kernel.

One unit of work per key/value batch position (with grouped-query attention,
per key/value head: the unit handles every query head of its group).  The
units are dealt to ``n_slots`` parallel tasks in a fixed order, so each
gradient is summed in the same order on every run (no atomics):

    for each unit:                          # e.g. (b, kv head)
        for kb in key blocks:
            dk, dv = 0                      # the key block's gradients, in locals
            for each query head g of the group:
                prologue (GQA head, query-loop bounds from the IR)
                for qb in [first, end):     # skipped, masked or full per the IR's classification
                    s = q_tile @ kt; dp = d_out_tile @ vt   # BLAS; kt, vt: the key block's k, v transposed once
                    per element: score, mask, p = exp(s - lse), ds = p (dp - delta)
                    (ds = p (dp w - delta) and p w into dv with a weight w: dropout),
                                 the score's derivative -> ds_raw, site contributions
                    dv += pᵀ d_out_tile;  dk += ds_rawᵀ q_tile          # BLAS, accumulating in place
                    dq[rows of the tile] += ds_raw k_tile                 # this unit owns these rows
            store dk, dv rows of the key block

Gradients of captured tensors the score reads (slopes, tables) are summed per
task into ``part_k[slot]`` and added up by the driver afterwards.
"""

from __future__ import annotations

from attncomp.backends.backward_tiles import BackwardTile, TiledBackward
from attncomp.backends.codegen import NUMPY_SCALAR, KernelSource, dim_expr
from attncomp.backends.numba_cpu import signatures as sig
from attncomp.backends.numba_cpu.kernel import FUNCTIONS
from attncomp.backends.tiles import element_expr
from attncomp.ir.core import Value
from attncomp.ir.dims import dim
from attncomp.ir.types import accumulation_dtype


class BackwardKernelWriter(KernelSource):
    functions = FUNCTIONS
    unsigned_gathers = True  # as the forward's (``kernel.KernelWriter``)

    def __init__(
        self,
        name: str,
        tiled: TiledBackward,
        captured: dict[Value, str],
        dims: list[str],
        transposed: dict[Value, tuple[int, ...]] | None = None,
    ):
        super().__init__(captured, dims)
        self.name = name
        self.t = tiled
        #: tile sources passed as the array before their transpose (``signatures.transposes_in_place``)
        self.transposed = {v: p for v, p in (transposed or {}).items() if v in captured}
        self.acc_dtype = accumulation_dtype(tiled.grid.results[0].type.dtype)
        self.acc = NUMPY_SCALAR[self.acc_dtype]
        self.nb = tiled.grid.results[0].type.rank - 2
        self.group = dim_expr(dim(tiled.grid.attrs["kv_repeat"]))

    def params(self) -> list[str]:
        parts = [f"part_{k}" for k in range(len(self.t.site_ranks))]
        return [
            "out_dq",
            "out_dk",
            "out_dv",
            *parts,
            *self.captured.values(),
            *[f"d_{d}" for d in self.dims],
            "n_slots",
        ]

    def rows_of(self, load, start: str, count: str, array: str | None = None) -> str:
        """``src[batch..., start:start + count]`` of a tile load, read in place (or of ``array``): a
        transposed source's rows indexed in the passed array's order (rows a stride apart, each
        contiguous: BLAS reads them where they are)."""
        src = array or self.array_ref(load.operands[0])
        index = [*(self.scalar().ref(v) for v in load.operands[1:-1]), f"{start}:{start} + {count}"]
        perm = None if array else self.transposed.get(load.operands[0])
        return f"{src}[{', '.join(index if perm is None else sig.permuted(index, perm))}]"

    def row_value(self, load, row: str) -> str:
        """Element ``[batch..., row, 0]`` of a ``[..., T, 1]`` source (the LSE and delta rows)."""
        src = self.array_ref(load.operands[0])
        batch = [self.scalar().ref(v) for v in load.operands[1:-1]]
        return f"{src}[{''.join(b + ', ' for b in batch)}{row}, 0]"

    def tile(self, tile: BackwardTile, mask_when: str | None) -> None:
        """One (query block, key block) tile; one copy per tile class: ``mask_when`` is "True" or None."""
        w = self.w
        with_mask = mask_when is not None
        for op in tile.scalar_ops:
            self.scalar().op(op)
        w.line(f"i0 = {self.scalar().ref(tile.q_load.operands[-1])}")
        w.line("nq = min(BQ, n_rows - i0)")
        w.line(f"qs = {self.rows_of(tile.q_load, 'i0', 'nq')}")
        w.line(f"dos = {self.rows_of(tile.d_out_load, 'i0', 'nq')}")
        w.line("gemm(0, 0, nq, nk, n_d, qs, kt, 0.0, s)")
        w.line("gemm(0, 0, nq, nk, n_e, dos, vt, 0.0, dp)")
        batch = [self.scalar().ref(v) for v in tile.score.operands[:-3]]
        grad_batch = [self.scalar().ref(v) for v in tile.gradient.operands[:-4]]
        # A site whose index is the same for every element of the tile (a per-head slope) is summed
        # in a local and added once: an add to memory per element would keep the loop scalar.
        tile_sums: dict[int, str] = {}
        for k in range(len(self.t.site_ranks)):
            w.line(f"site_{k} = ACC(0.0)")
        w.line("for r in range(nq):")
        with w.indent():
            i = self.fresh("i")
            w.line(f"{i} = {element_expr(tile.score.operands[-3], self.names, 'r', '0', clamped=False)}")
            w.line(f"lse_r = {self.row_value(tile.lse_load, 'i0 + r')}")
            w.line(f"delta_r = {self.row_value(tile.delta_load, 'i0 + r')}")
            w.line("for c in range(nk):")
            with w.indent():
                j = self.fresh("j")
                w.line(f"{j} = {element_expr(tile.score.operands[-2], self.names, '0', 'c', clamped=False)}")
                (x,) = self.scalar().block(tile.score.regions[0], batch + [i, j, "s[r, c]"])
                visible = None
                if with_mask and tile.mask is not None:
                    mask_batch = [self.scalar().ref(v) for v in tile.mask.operands[:-2]]
                    (visible,) = self.scalar().block(tile.mask.regions[0], mask_batch + [i, j])
                # masked elements are selected away, not branched around, so the loop vectorises
                hidden = "" if visible is None else f" if {visible} else ACC(0.0)"
                w.line(f"pv = EXP(ACC({x} - lse_r)){hidden}")
                if tile.weight is None:
                    w.line("dsv = pv * (dp[r, c] - delta_r)")
                    w.line("pm[r, c] = pv")
                else:  # dropout: dp and the probabilities dv is made of carry the forward's weight
                    weight_batch = [self.scalar().ref(v) for v in tile.weight.operands[:-2]]
                    (factor,) = self.scalar().block(tile.weight.regions[0], weight_batch + [i, j])
                    w.line(f"wv = {factor}")
                    w.line("dsv = pv * (dp[r, c] * wv - delta_r)")
                    w.line("pm[r, c] = pv * wv")
                grads = self.scalar().block(tile.gradient.regions[0], grad_batch + [i, j, "s[r, c]", "dsv"])
                w.line(f"dsm[r, c] = {grads[0]}{hidden}")
                at = 1
                for k, rank in enumerate(self.t.site_ranks):
                    index = grads[at + 1 : at + 1 + rank]
                    if all(name in grad_batch or name.isdigit() for name in index):
                        tile_sums[k] = "".join(f", {x}" for x in index)
                        w.line(f"site_{k} += {grads[at]}{hidden}")
                    else:
                        # unsigned, as the gathers' (in range: ``gather_bounds``), so a row's adds vectorise
                        at_index = "".join(f", np.uint64({x})" for x in index)
                        w.line(f"part_{k}[slot{at_index}] += {grads[at]}{hidden}")
                    at += 1 + rank
        for k, index in tile_sums.items():
            w.line(f"part_{k}[slot{index}] += site_{k}")
        w.line("gemm(1, 0, nk, n_e, nq, pm, dos, 1.0, dv_acc)")
        w.line("gemm(1, 0, nk, n_d, nq, dsm, qs, 1.0, dk_acc)")
        w.line(f"gemm(0, 0, nq, n_d, nk, dsm, ks, 1.0, {self.rows_of(tile.q_load, 'i0', 'nq', 'out_dq')})")

    def loop_body(self) -> None:
        self.by_tile_class(self.t, self.tile)

    def param_types(self) -> list[str]:
        """Numba types of :meth:`params` (see ``signatures``)."""
        acc = self.acc_dtype
        results = self.t.grid.results
        outs = [sig.array_type(acc, r.type.rank) for r in results[:3]]
        parts = [sig.array_type(acc, r.type.rank + 1) for r in results[3:]]
        captured = sig.captured_types(self.t.grid, self.captured, acc)
        return outs + parts + captured + [sig.INT] * (len(self.dims) + 1)

    def header(self) -> None:
        t, w, nb = self.t, self.w, self.nb
        q_src = t.masked.q_load.operands[0]
        v_src = t.v_load.operands[0]
        w.line(f"ACC = {self.acc}")
        w.line(f"EXP = {'exp_nonpositive_f32' if self.acc == 'np.float32' else 'np.exp'}")
        w.line(f"BQ = {t.block_q}")
        w.line(f"BK = {t.block_k}")
        w.line(f"G = {self.group}")
        w.line(f"n_rows = {dim_expr(q_src.type.shape[-2])}")
        w.line(f"n_keys = {dim_expr(t.k_load.operands[0].type.shape[-2])}")
        w.line(f"n_d = {self.array_ref(q_src)}.shape[{q_src.type.rank - 1}]")
        w.line(f"n_e = {self.array_ref(v_src)}.shape[{v_src.type.rank - 1}]")
        w.line("n_kb = (n_keys + BK - 1) // BK")
        w.line("n_units = 1" + "".join(f" * out_dk.shape[{a}]" for a in range(nb)))

    def write(self, jit: sig.Jit) -> str:
        """``NAME_slot`` (one parallel task's units) and ``NAME``, which runs it on the workers
        through the shared parallel launch (as the forward kernel's ``write`` does)."""
        t, w, nb = self.t, self.w, self.nb
        params = ", ".join(self.params())
        with sig.packed_task(w, jit, self.name, f"{self.name}_slot", "slot", params, self.param_types()) as pack:
            self.header()
            for name, shape in (
                ("s", "(BQ, BK)"),
                ("dp", "(BQ, BK)"),
                ("pm", "(BQ, BK)"),
                ("dsm", "(BQ, BK)"),
                ("dk_acc", "(BK, n_d)"),
                ("dv_acc", "(BK, n_e)"),
                ("kt", "(n_d, BK)"),
                ("vt", "(n_e, BK)"),
            ):
                w.line(f"{name} = np.empty({shape}, dtype=ACC)")
            w.line("for unit in range(slot, n_units, n_slots):")
            with w.indent():
                w.line("rest = unit")
                for a in reversed(range(nb)):
                    w.line(f"kv_{a} = rest % out_dk.shape[{a}]")
                    w.line(f"rest = rest // out_dk.shape[{a}]")
                w.line("for kb in range(n_kb):")
                with w.indent():
                    w.line("j0 = kb * BK")
                    self.names[t.j0] = "j0"
                    w.line("nk = min(BK, n_keys - j0)")
                    w.line("dk_acc[:] = ACC(0.0)")
                    w.line("dv_acc[:] = ACC(0.0)")
                    self.positions()
                    # element by element: a slice assignment checks the shapes and compiles Numba's error
                    # message for a mismatch (string formatting, half of this module's code)
                    heads = "".join(f"kv_{a}, " for a in range(nb))
                    w.line("for c in range(nk):")
                    with w.indent():
                        for grad, acc, width in (("out_dk", "dk_acc", "n_d"), ("out_dv", "dv_acc", "n_e")):
                            w.line(f"for e in range({width}):")
                            w.line(f"    {grad}[{heads}j0 + c, e] = {acc}[c, e]")
        driver_signature = f"types.void(types.intp, {', '.join(self.param_types())})"
        w.line(str(jit.typed(driver_signature)))
        w.line(f"def {self.name}(slot_at, {params}):")
        with w.indent():
            w.line("blas_threads = pin_blas_threads()  # the slots' BLAS calls run on their own thread")
            sig.write_pack(w, pack, params)
            # a small call runs its slots in order on the calling thread (the same sums: each slot
            # adds its units in the same order), without starting the parallel workers
            w.line(f"if n_slots == 1 or out_dq.size * out_dk.shape[{nb}] * 3 < SERIAL_WORK:")
            with w.indent():
                w.line("for slot in range(n_slots):")
                with w.indent():
                    w.line("call_task(slot_at, np.int64(slot), n_slots, np.int64(0), pack_at)")
            w.line("else:")
            with w.indent():
                w.line("launch(slot_at, n_slots, pack_at)")
            w.line("keep_alive(pack)  # the arrays the slots read, held until they are done")
            w.line("restore_blas_threads(blas_threads)")
        sig.declare_addresses(w, self.name, [f"{self.name}_slot"])
        return w.text()

    def positions(self) -> None:
        """Loop over the query batch positions of the unit, then over their query blocks."""
        t, w = self.t, self.w
        for a, arg in enumerate(t.batch_args):
            step = "G" if a == 1 else "1"
            w.line(f"lo_{a} = 0 if out_dk.shape[{a}] == 1 else kv_{a} * {step}")
            w.line(f"hi_{a} = out_dq.shape[{a}] if out_dk.shape[{a}] == 1 else lo_{a} + {step}")
            w.line(f"for p_{a} in range(lo_{a}, hi_{a}):")
            w.depth += 1
            self.names[arg] = f"p_{a}"
        for op in t.prologue:
            self.scalar().op(op)
        w.line(f"ks = {self.rows_of(t.k_load, 'j0', 'nk')}")
        w.line(f"vs = {self.rows_of(t.v_load, 'j0', 'nk')}")
        w.line("transpose_into(ks, kt, nk)")
        w.line("transpose_into(vs, vt, nk)")
        lo, hi = (self.scalar().ref(v) for v in t.loop.operands[:2])
        w.line(f"for qb in range({lo}, {hi}):")
        with w.indent():
            self.names[t.loop.regions[0].args[0]] = "qb"
            self.loop_body()
        w.depth -= len(t.batch_args)


def write_backward_kernel(
    name: str,
    tiled: TiledBackward,
    captured: dict[Value, str],
    dims: list[str],
    jit: sig.Jit,
    transposed: dict[Value, tuple[int, ...]] | None = None,
) -> str:
    return BackwardKernelWriter(name, tiled, captured, dims, transposed).write(jit)
