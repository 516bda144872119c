"""The loops of a query-major kernel: a deterministic backward's dQ pass, on either kind of kernel.

One thread block per (query batch position, IR query block, part of the query block): its rows
are known before any key block, and it runs every key block in order, asking the IR's loop bounds
for that key block whether they reach its query block (a few integer operations per key block,
which keep the tile classes exact: the IR loops over query blocks inside a key block).  The scalar
dQ kernel (``simt/dq_kernel.py``) and the tensor-core one (``mma/deterministic.py``) share these
loops; what a tile computes is theirs (``key_tile``).
"""

from __future__ import annotations

from attncomp.backends.codegen import dim_expr
from attncomp.backends.tiles import LoweringError
from attncomp.ir.core import Op, Value


class QueryMajor:
    """The query block and key loop of a query-major backward writer (a ``BackwardKernelWriter``:
    its tiled backward ``t``, names, scalar emitter and source lines; ``BLOCK_INDEX`` and
    ``ROW_TYPE`` the types it decodes blocks and rows in)."""

    def site_add(self, k: int, contribution: str, index: list[str]) -> None:
        """Nothing: the key-major kernel sums the sites (a query-major kernel takes their slices, unused)."""

    def emit_needed(self, values: list[Value], ops: list[Op]) -> None:
        """Emit the ops of ``ops`` that ``values`` are computed from (the query rows' indices, before
        the key loop); they may read only what is known there: batch indices, ``qb``, captured values."""
        needed, chosen = set(values), []
        for op in reversed(ops):
            if any(r in needed for r in op.results):
                chosen.append(op)
                needed.update(op.operands)
        made = {r for op in chosen for r in op.results}
        unknown = [v for v in needed if v not in made and v not in self.names and v not in self.captured]
        if unknown:
            raise LoweringError("cuda backward dq: the query rows' indices depend on the key block")
        for op in reversed(chosen):
            self.scalar().op(op)

    def query_block(self, rows: int, parts: int) -> None:
        """This thread block's rows: ``nr`` (at most ``rows``) from ``i0 + r0``, part ``r0 / rows`` of
        the ``parts`` of IR query block ``qb`` of batch position ``bi_...``; the indices of its rows'
        loads (query, output gradient, log-sum-exp, delta)."""
        t, w = self.t, self.w
        tile = t.masked
        w.line(f"n_rows = {dim_expr(tile.q_load.operands[0].type.shape[-2])}")
        w.line(f"n_keys = {dim_expr(t.k_load.operands[0].type.shape[-2])}")
        w.line(f"n_kb = (n_keys + {t.block_k - 1}) // {t.block_k}")
        w.line(f"n_qb = {self.BLOCK_INDEX}((n_rows + {t.block_q - 1}) // {t.block_q})")
        w.line(f"task = {self.BLOCK_INDEX}(cuda.blockIdx.x)")
        w.line(f"r0 = {self.ROW_TYPE}((task % {parts}) * {rows})")
        w.line(f"qb = np.int64((task // {parts}) % n_qb)")
        self.batch = self.batch_indices(self.nb, f"task // {parts} // n_qb", "out_dq", integers=self.BLOCK_INDEX)
        for arg, name in zip(t.batch_args, self.batch):
            self.names[arg] = name
        self.names[t.loop.regions[0].args[0]] = "qb"
        loads = (tile.q_load, tile.d_out_load, tile.lse_load, tile.delta_load)
        self.emit_needed([v for load in loads for v in load.operands[1:]], tile.scalar_ops)
        w.line(f"i0 = {self.ref(tile.q_load.operands[-1])}")
        w.line(f"nq = {self.ROW_TYPE}(min({t.block_q}, n_rows - i0))")
        w.line(f"nr = {self.ROW_TYPE}(min({rows}, nq - r0))")
        w.line("if nr <= 0:  # a part past the last row: the whole block returns")
        with w.indent():
            w.line("return")

    def key_loop(self, hoisted: dict[Op, list[Op]]) -> None:
        """Every key block in order; the IR's query-loop bounds for it say whether it reaches ``qb``;
        each computed tile by ``key_tile(tile, mask_when, hoisted)``."""
        t, w = self.t, self.w
        w.line("for kb in range(n_kb):")
        with w.indent():
            w.line(f"j0 = kb * {t.block_k}")
            self.names[t.j0] = "j0"
            for op in t.prologue:
                self.scalar().op(op)
            lo, hi = (self.ref(v) for v in t.loop.operands[:2])
            w.line(f"if {lo} <= qb and qb < {hi}:")
            with w.indent():
                self.by_tile_class(t, lambda tile, mask_when: self.key_tile(tile, mask_when, hoisted), one_copy=True)
