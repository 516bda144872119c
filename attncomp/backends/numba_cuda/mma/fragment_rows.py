"""The rows of a tensor-core forward's accumulator fragments: scores, mask, online softmax, outputs.

A lane of ``mma/forward_kernel.py``'s kernels holds two query rows of each of its warp's 16-row tiles
(``ra``, ``rb`` of the first; ``rc``, ``rd`` of a second, ``MmaPlan.m_tiles``) and of each 8 keys (or
output columns) two columns, in the places of the atom's accumulator fragment (``atoms.ACCUMULATOR``,
the same for every atom).  A tile's fragments are named by :func:`tile_name`: ``s_{n}_{e}``,
``o_{en}_{e}`` for the first, ``s1_{n}_{e}``, ``o1_{en}_{e}`` for the second.  What it computes per
element of those fragments is written here once for the staged kernel, its asynchronous-copy variant
(``mma/flash_kernel.py``) and every operand type: the score region and the mask region at the
element's row and column, keys past the end hidden, the online softmax per row (the quad's max by
shuffles, one rescale), and each row's outputs, log-sum-exp or a key split's partial state.
"""

from __future__ import annotations

from attncomp.backends.lse_merge import write_finish
from attncomp.backends.numba_cuda.mma.atoms import ACCUMULATOR
from attncomp.backends.tiles import TileCompute
from attncomp.ir.core import Op, Value

#: the two rows of a lane in one tile (``ra = warp * 16 + g``, ``rb = ra + 8``): their letter by offset in a fragment
ROW_NAMES = dict(zip((row for row, _ in ACCUMULATOR.by_row()), "ab"))
#: the row of a lane (``ra`` or ``rb``) by accumulator register
ROW = tuple(f"r{ROW_NAMES[row]}" for row, _ in ACCUMULATOR.offsets)
#: the letters of a lane's rows, two a tile
LETTERS = "abcdefgh"


def tile_name(prefix: str, tile: int) -> str:
    """The name prefix of a fragment of a warp's 16-row tile ``tile``: ``s`` for the first, ``s1`` ..."""
    return f"{prefix}{tile}" if tile else prefix


def row_letter(tile: int, register: int) -> str:
    """The letter of the row of accumulator register ``register`` of tile ``tile``."""
    return LETTERS[len(ROW_NAMES) * tile + ACCUMULATOR.row_index(register)]


class FragmentRows:
    """The per-element and per-row code of a tensor-core forward writer (``MmaKernelWriter``, whose
    plan ``mp``, atom and source lines it uses)."""

    def lane_rows(self) -> list[tuple[int, int, tuple[int, ...], str]]:
        """(tile, row offset in the tile, its accumulator registers, letter) of each row a lane holds."""
        return [
            (tile, offset, halves, row_letter(tile, halves[0]))
            for tile in range(self.mp.m_tiles)
            for offset, halves in self.atom.c.by_row()
        ]

    def scored(
        self, compute: TileCompute, hoisted: dict[Op, list[Op]], cast: str = "", raw: bool = False
    ) -> tuple[dict, dict, list]:
        """The score region on every element a lane holds: (its rows' and columns' position names, by
        row name and by (tile, column offset); the (tile, register) of each element).  ``cast``
        wraps the positions (``np.int32``: one compare a masked element); ``raw``: the region is a
        scale folded into the softmax (``softmax_update``), the products are left as they are."""
        p, w, c = self.mp, self.w, self.atom.c

        def position(value: Value, row: str, col: str) -> str:
            expr = self.index_element(value, row, col)
            return f"{cast}({expr})" if cast else expr

        rows = {f"r{letter}": self.fresh("i") for *_, letter in self.lane_rows()}
        for r, name in rows.items():
            w.line(f"{name} = {position(compute.score.operands[-3], self.position_row(r), '0')}")
        cols = {}
        for n in range(p.chunk // c.cols):
            for half in c.columns():
                cols[n, half] = self.fresh("j")
                col = f"(c0 + {n * c.cols + half} + {c.col_term})"
                w.line(f"{cols[n, half]} = {position(compute.score.operands[-2], '0', col)}")
        elements = [(t, n, e) for t in range(p.m_tiles) for n in range(p.chunk // c.cols) for e in range(c.registers)]
        for t, n, e in elements if not raw else ():
            at = [rows[f"r{row_letter(t, e)}"], cols[n, c.offsets[e][1]]]
            s = f"{tile_name('s', t)}_{n}_{e}"
            x = self.apply(compute.score, hoisted[compute.score], [*at, s])
            w.line(f"{s} = ACC({x})")
        #: the chunk's positions, for the weight region after the softmax (:meth:`weigh`)
        self.chunk_positions = rows, cols, elements
        return rows, cols, elements

    def weigh(self, compute: TileCompute, hoisted: dict[Op, list[Op]]) -> None:
        """P times the weight region (attention dropout), after the rows' sums and before ``P V``, at
        the positions the chunk's scores were computed at."""
        if compute.weight is None:
            return
        c, w = self.atom.c, self.w
        rows, cols, elements = self.chunk_positions
        for t, n, e in elements:
            at = [rows[f"r{row_letter(t, e)}"], cols[n, c.offsets[e][1]]]
            weight = self.apply(compute.weight, hoisted[compute.weight], at)
            s = f"{tile_name('s', t)}_{n}_{e}"
            w.line(f"{s} = {s} * ACC({weight})")

    def scores(self, compute: TileCompute, masked: str | None, hoisted: dict[Op, list[Op]]) -> None:
        """The score region on every element a lane holds, the mask region where it applies, and
        keys past the end hidden."""
        p, w, c = self.mp, self.w, self.atom.c
        rows, cols, elements = self.scored(compute, hoisted)
        if masked is not None and compute.mask is not None:
            w.line(f"if {masked}:")
            with w.indent():
                for t, n, e in elements:
                    at = [rows[f"r{row_letter(t, e)}"], cols[n, c.offsets[e][1]]]
                    visible = self.apply(compute.mask, hoisted[compute.mask], at)
                    s = f"{tile_name('s', t)}_{n}_{e}"
                    w.line(f"{s} = select({visible}, {s}, NEG_INF)")
        w.line(f"if jc + {p.chunk} > n_keys:  # the last chunk: keys past the end")
        with w.indent():
            for t, n, e in elements:
                s = f"{tile_name('s', t)}_{n}_{e}"
                w.line(f"{s} = select(jc + {n * c.cols + c.offsets[e][1]} + {c.col_term} < n_keys, {s}, NEG_INF)")

    def softmax_update(self, scale: str | None = None) -> None:
        """Online softmax of the tile's scores, per row: the quad's max, one rescale, P = exp(S - m).
        ``scale``: the scores are ``scale`` (never negative) times the products held, so the row's
        max is of the products, then scaled (``m`` stays the max of the scores, in natural units),
        and ``scale`` joins the exponent's multiply-add (``scale_log2``: ``scale * log2 e``)."""
        p, w, c = self.mp, self.w, self.atom.c
        n_tiles = p.chunk // c.cols
        for t, _, halves, row in self.lane_rows():
            sn, on = tile_name("s", t), tile_name("o", t)
            if self.t.score_bound is not None:  # m is the scores' bound throughout: no max, no rescale
                w.line(f"m_log2_{row} = m_{row} * LOG2E")
                self.exponentials(sn, n_tiles, halves, row, scale)
                continue
            w.line(f"mx_{row} = {'NEG_INF' if scale else f'm_{row}'}")
            for n in range(n_tiles):
                for e in halves:
                    w.line(f"mx_{row} = max(mx_{row}, {sn}_{n}_{e})")
            if scale:
                w.line(f"m_new_{row} = max(m_{row}, quad_max(mx_{row}) * {scale})")
            else:
                w.line(f"m_new_{row} = quad_max(mx_{row})")
            w.line(f"m_safe_{row} = select(m_new_{row} == NEG_INF, ACC(0.0), m_new_{row})")
            # ex2.approx as P's: exact 1 where the max stays, 0 from no key yet (m = -inf)
            w.line(f"alpha_{row} = exp2_approx((m_{row} - m_safe_{row}) * LOG2E)")
            w.line(f"m_{row} = m_new_{row}")
            w.line(f"l_{row} = l_{row} * alpha_{row}")
            for en in range(p.value_dim // c.cols):
                for e in halves:
                    w.line(f"{on}_{en}_{e} = {on}_{en}_{e} * alpha_{row}")
            w.line(f"m_log2_{row} = m_safe_{row} * LOG2E")
            self.exponentials(sn, n_tiles, halves, row, scale)

    def exponentials(self, sn: str, n_tiles: int, halves: tuple[int, ...], row: str, scale: str | None) -> None:
        """P = exp(s - m) = 2^(s log2 e - m log2 e) of a row's elements: one multiply-add and ex2 each,
        added to the row's sum."""
        for n in range(n_tiles):
            for e in halves:
                x = f"{sn}_{n}_{e}"
                self.w.line(f"{x} = exp2_approx({x} * {f'{scale}_log2' if scale else 'LOG2E'} - m_log2_{row})")
                self.w.line(f"l_{row} += {x}")

    def position_row(self, row: str) -> str:
        """The row whose position lane row ``row`` (``ra`` ..) has: itself (``PackedHeads``: its row in its head)."""
        return row

    def row_index(self, x: str) -> str:
        """The output's index of lane row ``r{x}``, before the feature."""
        prefix = "".join(f"{self.names[a]}, " for a in self.t.batch_args)
        return f"{prefix}i0 + r{x}"

    def finish(self) -> None:
        """Each row's output and log-sum-exp (:meth:`row_outputs`), or this split's partial state
        (:meth:`partial_outputs`)."""
        w = self.w
        for *_, row in self.lane_rows():
            w.line(f"l_{row} = quad_sum(l_{row})")
        partial, finishes = self.stores_partial()
        for t, _, halves, row in self.lane_rows():
            if self.key_splits:
                w.line(f"if i0 + r{row} < n_rows and {partial}:  # this split's partial state")
                with w.indent():
                    w.line(f"flat = (task // n_qb) * n_rows + i0 + r{row}")
                    w.line("if tq == 0:")
                    with w.indent():
                        w.line(f"part_m[sp, flat] = m_{row}")
                        w.line(f"part_l[sp, flat] = l_{row}")
                    self.partial_outputs(halves, t)
                w.line(f"elif i0 + r{row} < n_rows{'' if finishes == 'True' else ' and ' + finishes}:")
            else:
                w.line(f"if i0 + r{row} < n_rows:")
            with w.indent():

                def outputs(denominator: str, row: str = row, halves: tuple[int, ...] = halves, t: int = t) -> None:
                    self.row_outputs(denominator, self.row_index(row), halves, t)

                rows = self.t.row_stores(self.row_index(row))
                write_finish(w, f"m_{row}", f"l_{row}", outputs, **rows, lse_when="tq == 0")

    def partial_outputs(self, halves: tuple[int, ...], tile: int = 0) -> None:
        """A row's accumulators (registers ``halves`` of each fragment of ``tile``) into ``part_o[sp, flat]``."""
        c, on = self.atom.c, tile_name("o", tile)
        for en in range(self.mp.value_dim // c.cols):
            for e in halves:
                self.w.line(f"part_o[sp, flat, {en * c.cols + c.offsets[e][1]} + {c.col_term}] = {on}_{en}_{e}")

    def row_outputs(self, denominator: str, at: str, halves: tuple[int, ...], tile: int = 0) -> None:
        """A row's outputs (index prefix ``at``): its accumulators (of ``tile``) over ``denominator``."""
        c, on = self.atom.c, tile_name("o", tile)
        for en in range(self.mp.value_dim // c.cols):
            for e in halves:
                index = f"{at}, {en * c.cols + c.offsets[e][1]} + {c.col_term}"
                self.w.line(f"out_0[{index}] = {self.narrow(f'{on}_{en}_{e} / {denominator}')}")
