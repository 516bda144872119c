"""Lowering an ``ac.tile_grid`` to a parallel Numba kernel.

One ``prange`` task per (batch position, query block).  Inside it:

    load the query tile (f32)           m = -inf, l = 0, acc = 0
    for kb in [kb_first, kb_end):       # bounds from the IR
        tile_class = ...                # the IR's classification code, or its default
        if tile_class == 0: continue    # skipped: nothing is loaded
        load k (transposed) and v tiles
        s = q_tile @ k_tile              # BLAS
        per row: score(s), mask only when tile_class == 1, online softmax
        acc += p @ v_tile                # BLAS
    out = acc / l, lse = m + log(l)     # rows with no visible key: 0 and -inf

The score and mask functions are the ``ac.map`` regions of the IR written as
scalar code; loop bounds, head mapping and classification are the IR's own
scalar ops.  Work buffers are per task and hold one tile each.
"""

from __future__ import annotations

from attncomp.backends.codegen import ScalarEmitter, SourceWriter, dim_expr
from attncomp.backends.tiles import TileCompute, TiledAttention, element_expr
from attncomp.ir.core import Value


class KernelWriter:
    """Writes one kernel function for one tiled attention."""

    def __init__(self, name: str, tiled: TiledAttention, captured: dict[Value, str], dims: list[str]):
        self.name = name
        #: the accumulation type: float64 for float64 specs, float32 otherwise
        self.acc = "np.float64" if tiled.grid.results[0].type.dtype == "f64" else "np.float32"
        self.t = tiled
        self.captured = captured  # outside value -> kernel parameter name
        self.dims = dims
        self.w = SourceWriter()
        self.counter = 0
        self.names: dict[Value, str] = {v: p for v, p in captured.items() if v.type.rank == 0}

    def fresh(self, hint: str) -> str:
        self.counter += 1
        safe = "".join(ch if ch.isalnum() else "_" for ch in hint)
        return f"{safe}_{self.counter}"

    def array_ref(self, value: Value) -> str:
        return self.captured[value]

    def scalar(self) -> ScalarEmitter:
        return ScalarEmitter(self.w, self.names, self.fresh, self.array_ref)

    def params(self) -> list[str]:
        outs = ["out_0", "out_1"] if self.t.with_lse else ["out_0"]
        return outs + list(self.captured.values()) + [f"d_{d}" for d in self.dims]

    # pieces -------------------------------------------------------------------
    def batch_decode(self, rank: int) -> list[str]:
        """Task index -> batch indices (row-major) and the query block."""
        w = self.w
        w.line("qb = task % n_qb")
        rest = "task // n_qb"
        names = [f"bi_{k}" for k in range(rank)]
        for k in reversed(range(rank)):
            w.line(f"rest_{k} = {rest}")
            w.line(f"{names[k]} = rest_{k} % out_0.shape[{k}]")
            rest = f"rest_{k} // out_0.shape[{k}]"
        return names

    def load_rows(self, dest: str, load_op, row0: str, n: str, transposed: bool) -> None:
        """Copy ``n`` rows of a tile load into ``dest`` (f32), zero the rest."""
        w = self.w
        src = self.array_ref(load_op.operands[0])
        batch = [self.names[v] if v in self.names else self.scalar().ref(v) for v in load_op.operands[1:-1]]
        prefix = "".join(f"{b}, " for b in batch)
        rows = load_op.attrs["rows"]
        width = f"{src}.shape[{load_op.operands[0].type.rank - 1}]"
        w.line(f"for rr in range({rows}):")
        with w.indent():
            w.line(f"if rr < {n}:")
            with w.indent():
                w.line(f"for dd in range({width}):")
                with w.indent():
                    target = f"{dest}[dd, rr]" if transposed else f"{dest}[rr, dd]"
                    w.line(f"{target} = ACC({src}[{prefix}{row0} + rr, dd])")
            w.line("else:")
            with w.indent():
                w.line(f"for dd in range({width}):")
                with w.indent():
                    target = f"{dest}[dd, rr]" if transposed else f"{dest}[rr, dd]"
                    w.line(f"{target} = ACC(0.0)")

    def row_loop(self, compute: TileCompute, with_mask: bool) -> None:
        """Score, optional mask and the online-softmax update for each query row."""
        w = self.w
        batch_vals = [self.scalar().ref(v) for v in compute.score.operands[:-3]]
        w.line("for r in range(nq):")
        with w.indent():
            i = self.fresh("i")
            w.line(f"{i} = {element_expr(compute.score.operands[-3], self.names, 'r', '0')}")
            w.line("mx = ACC(-np.inf)")
            w.line("for c in range(nk):")
            with w.indent():
                j = self.fresh("j")
                w.line(f"{j} = {element_expr(compute.score.operands[-2], self.names, '0', 'c')}")
                (x,) = self.scalar().block(compute.score.regions[0], batch_vals + [i, j, "s[r, c]"])
                if with_mask and compute.mask is not None:
                    mask_batch = [self.scalar().ref(v) for v in compute.mask.operands[:-2]]
                    (visible,) = self.scalar().block(compute.mask.regions[0], mask_batch + [i, j])
                    w.line(f"xv = {x} if {visible} else ACC(-np.inf)")
                else:
                    w.line(f"xv = {x}")
                w.line("s[r, c] = xv")
                w.line("mx = max(mx, xv)")
            w.line("m_new = m[r] if m[r] > mx else mx")
            w.line("m_safe = ACC(0.0) if m_new == -np.inf else m_new")
            w.line("alpha = EXP(ACC(m[r] - m_safe))")
            w.line("row_sum = ACC(0.0)")
            w.line("for c in range(nk):")
            with w.indent():
                w.line("p = EXP(ACC(s[r, c] - m_safe))")
                w.line("s[r, c] = p")
                w.line("row_sum += p")
            w.line("for c in range(nk, BK):")
            with w.indent():
                w.line("s[r, c] = ACC(0.0)")
            w.line("l[r] = alpha * l[r] + row_sum")
            w.line("m[r] = m_new")
            w.line("alphas[r] = alpha")

    def key_tile(self, compute: TileCompute, with_mask: bool) -> None:
        w = self.w
        for op in compute.scalar_ops:
            self.scalar().op(op)
        w.line(f"j0 = {self.scalar().ref(compute.k_load.operands[-1])}")
        w.line("nk = min(BK, n_keys - j0)")
        # Keys and values are read in place: a C-contiguous slice, so BLAS takes kᵀ as a transpose flag.
        w.line(f"ks = {self.tile_rows(compute.k_load)}")
        w.line(f"vs = {self.tile_rows(compute.v_load)}")
        w.line("if nk == BK:")
        with w.indent():
            w.line("np.dot(qt[:nq], ks.T, s[:nq])")
        w.line("else:")
        with w.indent():
            w.line("s[:nq, :nk] = np.dot(qt[:nq], ks.T)")
        self.row_loop(compute, with_mask)
        w.line("if nk == BK:")
        with w.indent():
            w.line("np.dot(s[:nq], vs, pv[:nq])")
        w.line("else:")
        with w.indent():
            w.line("pv[:nq] = np.dot(np.ascontiguousarray(s[:nq, :nk]), vs)")
        w.line("for r in range(nq):")
        with w.indent():
            w.line("for e in range(n_e):")
            with w.indent():
                w.line("acc[r, e] = acc[r, e] * alphas[r] + pv[r, e]")

    def tile_rows(self, load_op) -> str:
        """``src[batch..., j0:j0 + nk]`` for a key or value tile load."""
        src = self.array_ref(load_op.operands[0])
        batch = [self.scalar().ref(v) for v in load_op.operands[1:-1]]
        return f"{src}[{''.join(b + ', ' for b in batch)}j0:j0 + nk]"

    # the kernel ---------------------------------------------------------------
    def write(self, decorator: str) -> str:
        t, w = self.t, self.w
        nb = len(t.batch_args)
        q_src = self.array_ref(t.q_load.operands[0])
        k_src = self.array_ref(t.masked.k_load.operands[0])
        v_src = self.array_ref(t.masked.v_load.operands[0])
        w.line(decorator)
        w.line(f"def {self.name}({', '.join(self.params())}):")
        with w.indent():
            w.line(f"ACC = {self.acc}")
            w.line(f"EXP = {'exp_nonpositive_f32' if self.acc == 'np.float32' else 'np.exp'}")
            w.line(f"BQ = {t.block_q}")
            w.line(f"BK = {t.block_k}")
            w.line(f"n_rows = out_0.shape[{nb}]")
            # the keys' length from the IR's type: a decoder's cache buffer is longer than what it holds
            w.line(f"n_keys = {dim_expr(t.masked.k_load.operands[0].type.shape[-2])}")
            w.line(f"n_d = {q_src}.shape[{t.q_load.operands[0].type.rank - 1}]")
            w.line(f"n_e = {v_src}.shape[{t.masked.v_load.operands[0].type.rank - 1}]")
            w.line("n_qb = (n_rows + BQ - 1) // BQ")
            w.line("n_tasks = n_qb" + "".join(f" * out_0.shape[{k}]" for k in range(nb)))
            w.line("for task in prange(n_tasks):")
            with w.indent():
                batch = self.batch_decode(nb)
                for arg, name in zip(t.batch_args, batch):
                    self.names[arg] = name
                w.line("i0 = qb * BQ")
                self.names[t.i0] = "i0"
                w.line("nq = min(BQ, n_rows - i0)")
                for op in t.prologue:
                    self.scalar().op(op)
                w.line("qt = np.empty((BQ, n_d), dtype=ACC)")
                w.line("s = np.empty((BQ, BK), dtype=ACC)")
                w.line("pv = np.empty((BQ, n_e), dtype=ACC)")
                w.line("m = np.full(BQ, -np.inf, dtype=ACC)")
                w.line("l = np.zeros(BQ, dtype=ACC)")
                w.line("alphas = np.ones(BQ, dtype=ACC)")
                w.line("acc = np.zeros((BQ, n_e), dtype=ACC)")
                self.load_rows("qt", t.q_load, "i0", "nq", transposed=False)
                lo, hi = (self.scalar().ref(v) for v in t.loop.operands[:2])
                w.line(f"for kb in range({lo}, {hi}):")
                with w.indent():
                    self.names[t.loop.regions[0].args[0]] = "kb"
                    self.loop_body()
                self.finish()
        return w.text()

    def loop_body(self) -> None:
        t, w = self.t, self.w
        if t.tile_class is None:
            self.key_tile(t.masked, with_mask=t.default_class == 1)
            return
        for op in t.classify_ops:
            self.scalar().op(op)
        tile_class = self.scalar().ref(t.tile_class)
        w.line(f"if {tile_class} == 1:")
        with w.indent():
            self.key_tile(t.masked, with_mask=True)
        w.line(f"elif {tile_class} == 2:")
        with w.indent():
            self.key_tile(t.full or t.masked, with_mask=False)

    def finish(self) -> None:
        t, w = self.t, self.w
        prefix = "".join(f"{self.names[a]}, " for a in t.batch_args)
        w.line("for r in range(nq):")
        with w.indent():
            w.line("denominator = l[r] if l[r] != 0.0 else ACC(1.0)")
            w.line("for e in range(n_e):")
            with w.indent():
                w.line(f"out_0[{prefix}i0 + r, e] = acc[r, e] / denominator")
            if t.with_lse:
                w.line(f"out_1[{prefix}i0 + r] = -np.inf if l[r] == 0.0 else m[r] + math.log(l[r])")


def write_kernel(name: str, tiled: TiledAttention, captured: dict[Value, str], dims: list[str],
                 decorator: str) -> str:
    return KernelWriter(name, tiled, captured, dims).write(decorator)

