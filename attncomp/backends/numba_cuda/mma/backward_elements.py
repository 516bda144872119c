"""The elements of a tensor-core backward's fragments: score, mask, gradient regions, sites, stores.

A lane of ``mma/backward_kernel.py``'s kernel holds, of ``S^T`` and ``dP^T`` (keys on the rows of the
products), keys ``g`` and ``g + 8`` of its warp's 16 and of each 8 query rows two, in the places of
the atom's accumulator fragment (``atoms.ACCUMULATOR``, the same for every atom).  What it computes
per element is written here once for every operand type: validity and the mask region, ``p = exp(s -
lse)``, ``ds = p (dp - delta)`` through the gradient region, the sites' contributions (summed in a
register where their index is the same for the whole kernel), and the dK and dV fragments stored
into the key/value head's rows at the end.
"""

from __future__ import annotations

from contextlib import nullcontext

from attncomp.backends.backward_tiles import BackwardTile
from attncomp.ir.core import Op


class BackwardElements:
    """The per-element code and the stores of a tensor-core backward writer
    (``MmaBackwardKernelWriter``, whose plan ``mp``, atom, sites and source lines it uses)."""

    #: where a warp's rows start in the chunk, as a term of a sum ("": the chunk's first row; a
    #: writer whose warps share the rows names it)
    ROW_BASE = ""
    #: the integer type positions are named in, once a chunk (keys) or fragment (rows); None: each
    #: use recomputes its expression (``index_exprs``)
    POSITIONS: str | None = None

    def named(self, texts: dict, known: dict[str, str], hint: str) -> dict:
        """``texts`` (position expressions by key) as ``POSITIONS`` names, one per distinct expression
        (``known``: those named so far)."""
        found = {}
        for key, text in texts.items():
            if text not in known:
                known[text] = self.fresh(hint)
                self.w.line(f"{known[text]} = {self.POSITIONS}({text})")
            found[key] = known[text]
        return found

    def index_exprs(self, map_op: Op, n_index: int) -> tuple[dict[tuple[int, int], str], dict[int, str]]:
        """A region's row index per (8-row fragment, row of the lane's pair) and its key index per
        key half, as expressions: recomputed where they are used, which costs a few integer adds and
        keeps no registers across the chunk's elements."""
        index = map_op.operands[len(map_op.operands) - n_index :][:2]
        c = self.atom.c
        rows, cols = {}, {}
        for n in range(self.mp.rows // c.cols):
            for b in c.columns():
                row = f"(r0 + {self.ROW_BASE}{n * c.cols + b} + {c.col_term})"
                rows[n, b] = self.index_element(index[0], row, "0")
        for h, (offset, _) in enumerate(c.by_row()):
            cols[h] = self.index_element(index[1], "0", f"(koff + w16 + {c.row_term} + {offset})")
        return rows, cols

    def elements(
        self, tile: BackwardTile, masked: str | None, hoisted: dict[Op, list[Op]], fragments: range | None = None
    ) -> None:
        """Per element of ``S^T`` and ``dP^T`` (of the 8-row ``fragments``, default all): p into
        ``s_{n}_{e}``, ds_raw into ``ds_{n}_{e}``."""
        p, w, c = self.mp, self.w, self.atom.c
        rows, cols = self.index_exprs(tile.score, 3)
        g_rows, g_cols = self.index_exprs(tile.gradient, 4)
        with_mask = masked is not None and tile.mask is not None
        m_rows, m_cols = self.index_exprs(tile.mask, 2) if with_mask else ({}, {})
        fragments = range(p.rows // c.cols) if fragments is None else fragments
        elements = [(n, e) for n in fragments for e in range(c.registers)]
        for h, (offset, _) in enumerate(c.by_row()):
            w.line(f"key_ok_{h} = w16 + {c.row_term} + {offset} < nk")
        maps = [(rows, cols), (g_rows, g_cols), (m_rows, m_cols)]
        left = f"r0 + {self.ROW_BASE}{{}} + {c.col_term} < nq"
        if self.POSITIONS is not None:  # named: each key's positions once, each row's per fragment
            known: dict[str, str] = {}
            maps = [(rs, self.named(cs, known, "j")) for rs, cs in maps]
            first = f"r0 + {self.ROW_BASE}{c.col_term}"
            w.line(f"left = {self.POSITIONS}(nq - ({first}))  # the rows from this lane's first")
            left = "{} < left"
        for n, e in elements:
            if e == 0:  # the log-sum-exp and delta of the fragment's rows, read once for both keys
                for b in c.columns():
                    w.line(f"lse_{b} = lse_sh[{self.ROW_BASE}{n * c.cols + b} + {c.col_term}]")
                    w.line(f"delta_{b} = delta_sh[{self.ROW_BASE}{n * c.cols + b} + {c.col_term}]")
                if self.POSITIONS is not None:
                    fragment: dict[str, str] = {}
                    for rs, _ in maps:
                        rs.update(self.named({(n, b): rs[n, b] for b in c.columns() if (n, b) in rs}, fragment, "i"))
            (rows, cols), (g_rows, g_cols), (m_rows, m_cols) = maps
            # each element's validity just before its use: eight flags live at once cost registers
            # beside the dK and dV fragments
            h, b = c.row_index(e), c.offsets[e][1]
            w.line(f"v_{n}_{e} = key_ok_{h} & ({left.format(n * c.cols + b)})")
            if with_mask:
                w.line(f"if v_{n}_{e} and {masked}:")
                with w.indent():
                    (seen,) = self.apply_all(tile.mask, hoisted[tile.mask], [m_rows[n, b], m_cols[h]])
                    w.line(f"v_{n}_{e} = {seen}")
            self.score_element(tile, n, e, (rows, cols, g_rows, g_cols), hoisted)
            self.element_done(n, e)

    def element_done(self, n: int, e: int) -> None:
        """After element ``e`` of 8-row fragment ``n``: nothing here (a writer may pack its pair)."""

    def score_element(self, tile: BackwardTile, n: int, e: int, index: tuple, hoisted: dict[Op, list[Op]]) -> None:
        """Element ``e`` of 8-row fragment ``n``: p over its score, ds_raw over its dP (``index``: the
        score's and the gradient's row and key expressions, ``index_exprs``)."""
        w, c = self.w, self.atom.c
        rows, cols, g_rows, g_cols = index
        h, b = c.row_index(e), c.offsets[e][1]
        s, dp = f"s_{n}_{e}", f"ds_{n}_{e}"
        w.line("pv = ZERO")
        w.line("dsv = ZERO")
        w.line(f"if v_{n}_{e}:")
        with w.indent():
            (x,) = self.apply_all(tile.score, hoisted[tile.score], [rows[n, b], cols[h], s])
            w.line(f"pv = exp2_approx(ACC({x}) * LOG2E - lse_{b})")
            # dropout: dP, and the p that dV is made of, carry the forward's weight
            wv = tile.weight and self.weight_factor(tile.weight, hoisted, [rows[n, b], cols[h]])
            w.line(f"gv = pv * ({dp}{f' * {wv}' if wv else ''} - delta_{b})")
            at_element = [g_rows[n, b], g_cols[h], s, "gv"]
            grads = self.apply_all(tile.gradient, hoisted[tile.gradient], at_element)
            w.line(f"dsv = ACC({grads[0]})")
            at = 1
            for k, (rank, _, _) in enumerate(self.sites):
                self.site_add(k, grads[at], grads[at + 1 : at + 1 + rank])
                at += 1 + rank
            if wv:
                w.line(f"pv = pv * {wv}")
        w.line(f"{s} = pv")
        w.line(f"{dp} = dsv")

    def find_uniform_sites(self, gradient: Op, rest: list[Op]) -> None:
        """The sites whose index is the same for every element of the kernel (ALiBi's ``slopes[h]``):
        known before the tile loop, so a lane sums into one register and adds it once at the end,
        without the scalar kernel's per-element check for a new index (whose inlined flushes cost
        registers beside the fragments)."""
        region = gradient.regions[0]
        variant = set(region.args[len(region.args) - 4 :]) | {r for op in rest for r in op.results}
        yields = region.ops[-1].operands
        self.uniform: set[int] = set()
        at = 1
        for k, (rank, _, current) in enumerate(self.sites):
            index = yields[at + 1 : at + 1 + rank]
            if rank and not any(v in variant for v in index):
                self.uniform.add(k)
                for name, value in zip(current, index):
                    self.w.line(f"{name} = np.int64({self.ref(value)})")
            at += 1 + rank

    def site_add(self, k: int, contribution: str, index: list[str]) -> None:
        if k in self.uniform:
            self.w.line(f"{self.sites[k][1]} += ACC({contribution})")
        else:
            super().site_add(k, contribution, index)

    def site_flush(self, k: int) -> None:
        rank, acc, current = self.sites[k]
        if k not in self.uniform:
            super().site_flush(k)
            return
        inside = " and ".join(f"0 <= {x} < site_{k}.shape[{a}]" for a, x in enumerate(current))
        self.w.line(f"if {inside}:")
        with self.w.indent():
            at = current[0] if rank == 1 else f"({', '.join(current)})"
            self.w.line(f"cuda.atomic.add(site_{k}, {at}, {acc})")

    def store(self) -> None:
        """The dK, dV fragments into the key/value head's rows; the sites' last runs."""
        p, w, c = self.mp, self.w, self.atom.c
        prefix = self.kv_prefix()
        for offset, registers in c.by_row():
            w.line(f"if w16 + {c.row_term} + {offset} < nk:")
            with w.indent():
                w.line(f"key = j0 + koff + w16 + {c.row_term} + {offset}")
                for atomic in (True, False):
                    w.line("if kv_atomic:" if atomic else "else:")
                    with w.indent():
                        shares = (("out_dk", "dk", p.d_share, self.fd), ("out_dv", "dv", p.e_share, self.fe))
                        for out, acc, width, first in shares:
                            for en in range(width // c.cols):
                                for e in registers:
                                    at = f"{prefix}key, {first} + {en * c.cols + c.offsets[e][1]} + {c.col_term}"
                                    value = f"{acc}_{en}_{e}"
                                    if atomic:
                                        w.line(f"cuda.atomic.add({out}, ({at}), {value})")
                                    else:
                                        w.line(f"{out}[{at}] = {value}")
        if p.halves > 1 and self.sites:
            w.line("if half == 0:  # both halves summed the sites' contributions: one adds them")
        with w.indent() if p.halves > 1 and self.sites else nullcontext():
            for k in range(len(self.sites)):
                self.site_flush(k)
