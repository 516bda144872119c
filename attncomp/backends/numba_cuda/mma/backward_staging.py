"""How a tensor-core backward's tiles reach shared memory: keys, values, query and output-gradient rows.

Every tile lives in one shared array of 32-bit words (``sh``, at the offsets of
``MmaBackwardPlan.layout``).  16-bit operands are staged two elements a word, row by row, and then
traded into transposed copies in shared memory (``transpose_pairs``: the keys once per thread block,
each chunk's query and output-gradient rows), so that every B fragment reads two neighbouring ``k`` in
one word and every element is read from global memory once.  float32 operands are staged as whole
words (``Operands.stored``: rounded to tf32, or whole for 3xTF32), row by row, with no transposed
copy.  Rows past the count are zero, so that they weigh nothing in the products.
"""

from __future__ import annotations

from attncomp.backends.backward_tiles import BackwardTile
from attncomp.backends.numba_cuda.mma.atoms import HALF_SHIFTS
from attncomp.ir.core import Op


class BackwardStaging:
    """The staging code of a tensor-core backward writer (``MmaBackwardKernelWriter``, whose plan
    ``mp``, operands, loads and source lines it uses)."""

    def sh(self, tile: str, index: str) -> str:
        """Word ``index`` of a shared tile (``backward_plan.MmaBackwardPlan.layout``)."""
        return f"sh[U({self.mp.layout[tile]} + {index})]"

    def stage_pairs(self, tile: str, load: Op, first: str, count: str, rows: int, width: int, pitch: int) -> None:
        """``rows`` rows of a load from row ``first`` into ``tile[row][feature / 2]`` (float32:
        ``tile[row][feature]``, ``Operands.stored``); zero past ``count``."""
        w, words = self.w, width // 2
        if not self.operands.packed:
            w.line(f"for e_idx in range(tid, {rows * width}, {self.threads}):")
            with w.indent():
                w.line(f"rr = e_idx // {width}")
                w.line(f"ww = e_idx - rr * {width}")
                w.line(f"x_f = ACC({self.element(load, f'{first} + rr', 'ww')}) if rr < {count} else ZERO")
                w.line(f"{self.sh(tile, f'rr * {pitch} + ww')} = {self.operands.stored('x_f')}")
            return
        w.line(f"for e_idx in range(tid, {rows * words}, {self.threads}):")
        with w.indent():
            w.line(f"rr = e_idx // {words}")
            w.line(f"ww = e_idx - rr * {words}")
            w.line(f"if rr < {count}:")
            with w.indent():
                row = f"{first} + rr"
                pair = f"{self.element(load, row, '2 * ww')}, {self.element(load, row, '2 * ww + 1')}"
                w.line(f"{self.sh(tile, f'rr * {pitch} + ww')} = {self.operands.pack_loaded}({pair})")
            w.line("else:")
            with w.indent():
                w.line(f"{self.sh(tile, f'rr * {pitch} + ww')} = np.uint32(0)")

    def transpose_pairs(
        self, dst: str, src: str, rows: int, width: int, src_pitch: int, dst_pitch: int, first: str
    ) -> None:
        """``dst[feature][row / 2]`` for ``width`` features from ``first`` (even), from a staged
        ``src[row][feature / 2]`` (after a barrier): the 16-bit halves traded in shared memory, so
        each element is read from global memory once; rows past the count are zero in ``src``."""
        w = self.w
        w.line(f"for e_idx in range(tid, {rows // 2 * width}, {self.threads}):")
        with w.indent():
            w.line(f"rw = e_idx // {width}")
            w.line(f"ff = e_idx - rw * {width}")
            w.line(f"shift = (ff & 1) * {HALF_SHIFTS[1]}")
            word = f"(({first} + ff) >> 1)"
            w.line(f"lo = ({self.sh(src, f'2 * rw * {src_pitch} + {word}')} >> shift) & 0xFFFF")
            w.line(f"hi = ({self.sh(src, f'(2 * rw + 1) * {src_pitch} + {word}')} >> shift) & 0xFFFF")
            w.line(f"{self.sh(dst, f'ff * {dst_pitch} + rw')} = np.uint32(lo | (hi << 16))")

    def stage_rows(self, tile: BackwardTile) -> None:
        """The chunk's query and output-gradient rows, both ways, and its log-sum-exp (times log2 e)
        and delta."""
        p, first = self.mp, "i0 + r0"
        self.stage_pairs("q", tile.q_load, first, "nr", p.rows, p.head_dim, p.k_pitch)
        self.stage_pairs("o", tile.d_out_load, first, "nr", p.rows, p.value_dim, p.v_pitch)
        self.stage_row_sums(tile)

    def stage_row_sums(self, tile: BackwardTile) -> None:
        """The chunk's log-sum-exp (times log2 e) and delta into ``lse_sh`` and ``delta_sh``, zero past
        its rows: a row a thread, from the (batch, head) slices, unsigned indices (no negative-index
        fix-ups)."""
        p, w = self.mp, self.w
        # the (batch, head) rows, indexed from the chunk's first: no slice's bounds arithmetic
        w.line(f"lse_rows = {self.slice_of(tile.lse_load)}")
        w.line(f"delta_rows = {self.slice_of(tile.delta_load)}")
        if p.rows > self.threads:
            w.line(f"for rr in range(tid, {p.rows}, {self.threads}):")
        else:
            w.line("rr = tid")
            w.line(f"if rr < {p.rows}:")
        with w.indent():
            w.line("inside = rr < nr")
            w.line("lse_sh[rr] = ACC(lse_rows[U(i0 + r0 + rr), 0]) * LOG2E if inside else ZERO")
            w.line("delta_sh[rr] = ACC(delta_rows[U(i0 + r0 + rr), 0]) if inside else ZERO")

    def stage_keys(self, first: str) -> None:
        """The block's keys and values from row ``first``, and the keys transposed."""
        t, p, w = self.t, self.mp, self.w
        self.stage_pairs("k", t.k_load, first, "nk", p.keys, p.head_dim, p.k_pitch)
        self.stage_pairs("v", t.v_load, first, "nk", p.keys, p.value_dim, p.v_pitch)
        if not self.operands.packed:  # no transposed keys
            return
        w.line("cuda.syncthreads()")
        self.transpose_pairs("kt", "k", p.keys, p.d_share, p.k_pitch, p.kt_pitch, self.fd)
