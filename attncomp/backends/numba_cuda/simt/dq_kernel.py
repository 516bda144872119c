"""The query-major dQ kernel of a deterministic backward: dQ summed in registers, stored once.

One thread block per (query batch position, IR query block, part of the query block),
``plan.threads`` threads: ``lanes`` threads per query row, lane ``g`` keeping features ``g, g +
lanes, ...`` of its row's dQ in registers (``simt/dq_plan.py``).  Each thread block runs:

    q, d_out rows of its queries -> shared          dq slices = 0            (registers)
    for kb in [0, n_kb):                             # every key block, in order
        prologue (GQA head, the query-loop bounds of key block kb: the IR's scalar ops)
        if qb is inside those bounds:                # else the key block skips this query block
            tile_class = ...                          # the IR's classification: skip class 0
            for each chunk of ``keys`` keys of the block:
                k, v rows -> shared                                                   syncthreads
                per (row, key) element, one thread: s = q.k, dp = d_out.v, the score region, the
                    mask region (class 1 only), p = exp(s - lse), ds = p (dp - delta), the
                    gradient region -> ds_raw -> shared                                 syncthreads
                dq slice += ds_raw k                                                  (registers)
    dq slices -> the rows of out_dq (plain stores: this thread block owns them)

The key blocks come in the same order on every run and each row's sum is one thread's, so dQ is
the same to the bit from run to run; the key-major kernel (``simt/deterministic_backward.py``) computes
dK, dV and the sites.  The per-element code (scores, mask, ``p``, ``ds_raw``) is the key-major
kernels' (``BackwardKernelWriter.element``), with the roles of the staged rows and keys swapped:
a thread's row is fixed and its keys move.  The IR loops over query blocks inside a key block;
this kernel asks, for every key block, whether the IR's bounds for it hold its query block, which
costs a few integer operations per key block and keeps the tile classes exact.
"""

from __future__ import annotations

from attncomp.backends.backward_tiles import BackwardTile, TiledBackward
from attncomp.backends.numba_cuda.query_major import QueryMajor
from attncomp.backends.numba_cuda.simt.backward_kernel import BackwardKernelWriter
from attncomp.backends.numba_cuda.simt.dq_plan import DqPlan
from attncomp.ir.core import Op, Value


class DqKernelWriter(QueryMajor, BackwardKernelWriter):
    """Writes the dQ kernel of one deterministic ``ac.key_grid`` for one plan (the kernel function
    only: it joins the key-major kernel's module)."""

    def __init__(self, name: str, tiled: TiledBackward, captured: dict[Value, str], dims: list[str], plan: DqPlan):
        super().__init__(name, tiled, captured, dims, plan)  # type: ignore[arg-type]

    def key_tile(self, tile: BackwardTile, masked: str | None, hoisted: dict[Op, list[Op]]) -> None:
        """One (query block, key block) tile: its keys a chunk at a time; dq slices += ds_raw k."""
        t, p, w = self.t, self.plan, self.w
        for op in tile.scalar_ops:
            self.scalar().op(op)
        w.line(f"for koff in range(0, {p.block_k}, {p.keys}):")
        with w.indent():
            w.line(f"nk = min(min({p.keys}, {p.block_k} - koff), n_keys - j0 - koff)")
            w.line("if nk > 0:")
            with w.indent():
                w.line("cuda.syncthreads()  # every thread is done with the previous chunk")
                first = f"{self.ref(t.k_load.operands[-1])} + koff"
                self.stage("k_tile", t.k_load, "nk", first, p.head_dim, p.head_pitch, p.keys)
                first = f"{self.ref(t.v_load.operands[-1])} + koff"
                self.stage("v_tile", t.v_load, "nk", first, p.value_dim, p.value_pitch, p.keys)
                w.line("cuda.syncthreads()")
                w.line(f"for c in range(g, {p.keys}, {p.lanes}):" if p.lanes > 1 else f"for c in range({p.keys}):")
                with w.indent():
                    self.element(tile, masked, hoisted)
                    w.line("ds_tile[rr, c] = dsv")
                w.line("cuda.syncthreads()")
                w.line("for cc in range(nk):")
                with w.indent():
                    w.line("dw = ds_tile[rr, cc]")
                    for k in range(p.head_slice):
                        w.line(f"dq_{k} += dw * k_tile[cc, {self.feature(k)}]")

    def store(self) -> None:
        """The dq slices into this thread block's rows of out_dq."""
        p, w = self.plan, self.w
        prefix = "".join(f"{n}, " for n in self.batch)
        w.line("if rr < nr:")
        with w.indent():
            for k in range(p.head_slice):
                self.guarded(k, p.head_dim, f"out_dq[{prefix}i0 + r0 + rr, {self.feature(k)}] = dq_{k}")

    def write(self, func_name: str = "") -> str:
        t, p, w = self.t, self.plan, self.w
        with self.kernel_body(p.lanes, "rr"):
            self.query_block(p.rows, p.parts)
            w.line(f"q_tile = cuda.shared.array(({p.rows}, {p.head_pitch}), {self.acc})")
            w.line(f"o_tile = cuda.shared.array(({p.rows}, {p.value_pitch}), {self.acc})")
            w.line(f"k_tile = cuda.shared.array(({p.keys}, {p.head_pitch}), {self.acc})")
            w.line(f"v_tile = cuda.shared.array(({p.keys}, {p.value_pitch}), {self.acc})")
            w.line(f"ds_tile = cuda.shared.array(({p.rows}, {p.ds_pitch}), {self.acc})")
            tile = t.masked
            self.stage("q_tile", tile.q_load, "nr", "i0 + r0", p.head_dim, p.head_pitch, p.rows)
            self.stage("o_tile", tile.d_out_load, "nr", "i0 + r0", p.value_dim, p.value_pitch, p.rows)
            hoisted = self.hoist_regions()
            for k in range(p.head_slice):
                w.line(f"dq_{k} = ACC(0.0)")
            self.key_loop(hoisted)
            self.store()
        return w.text()
