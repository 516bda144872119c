"""Tensor-core decoding: the query heads that share a key/value head packed into one tile's rows.

A decode step of grouped-query attention has a few query rows per head (one, or a few for
speculative steps), too few for the 16 rows of an ``mma`` tile.  But the ``G`` query heads of a
group (``kv_repeat``: GQA 32/8 has four) read the same keys and values, so their rows fit one tile
together: a thread block of the asynchronous-copy kernel (``mma/flash_kernel.py``) takes one (batch
position, key/value head) and the group's ``G x T`` rows, packed head by head (row ``r`` is head
``h0 + r // T``, row ``r % T`` of it).  Each key and value chunk is then copied once a group, not
once a head, and multiplied on tensor cores; the key splits and their merge are the usual ones, with
the packed rows as a unit's rows.

A grid packs only where the heads' rows differ in their query alone: nothing but the query's load
and the key/value head's division reads the head (:func:`packed_head`).  A score, a mask or a
prologue that reads it (a per-head bias, ALiBi's slopes) keeps a head a block.
"""

from __future__ import annotations

from attncomp.backends.codegen import dim_expr
from attncomp.backends.numba_cuda.mma.fragment_rows import ROW_NAMES
from attncomp.backends.tiles import TiledAttention
from attncomp.ir.core import Op, Value
from attncomp.ir.dims import dim


def packed_head(t: TiledAttention) -> Value | None:
    """The grid's head index (its last batch axis) where the rows of a group's query heads can share
    a tile: the grid has a ``kv_repeat`` past 1, and the head is read only by the query's load (as
    its last batch index), by its division into the key/value head, and by maps whose regions do not
    use it; else None."""
    repeat = t.grid.attrs.get("kv_repeat")
    if repeat is None or dim(repeat) == dim(1) or len(t.batch_args) != 2:
        return None
    head = t.batch_args[-1]
    for op in t.grid.regions[0].walk():
        if not any(x is head for x in op.operands):
            continue
        if op is t.q_load and op.operands[-2] is head and not any(x is head for x in op.operands[:-2]):
            continue
        if op.name == "ac.floordiv" and op.operands[0] is head and _is_repeat(op.operands[1], repeat):
            continue
        if op.name == "ac.map" and not _region_reads(op, head):
            continue
        return None
    return head


def _is_repeat(value: Value, repeat: object) -> bool:
    """Whether ``value`` is the grid's ``kv_repeat``: a size (``H // KV``) or a constant (a spec's
    ``n_rep = 4``)."""
    owner = value.owner
    if not isinstance(owner, Op) or owner.name not in ("ac.dim", "ac.constant"):
        return False
    size = owner.attrs["value"]
    return (owner.name == "ac.dim" or isinstance(size, int)) and dim(size) == dim(repeat)


def _region_reads(op: Op, head: Value) -> bool:
    """Whether a map's region uses the argument ``head`` is bound to."""
    region = op.regions[0]
    bound = {arg for arg, x in zip(region.args, op.operands) if x is head}
    return any(x in bound for inner in region.walk() for x in inner.operands)


class PackedHeads:
    """The packed rows of a ``FlashKernelWriter`` whose plan packs heads (``KernelChoice.packed_heads``):
    which unit a block is, where a lane's rows come from, and where their outputs go."""

    @property
    def packed(self) -> bool:
        return bool(self.mp.choice.packed_heads)

    def packed_position(self) -> None:
        """The block's (batch position, key/value head) unit, the group's first query head ``h0``,
        the rows of one head (``n_t``) and of the group (``n_rows``); per row a lane holds, its head
        in the group ``g{x}`` and its row ``t{x}`` (rows past the end clamped to the last)."""
        t, w = self.t, self.w
        b, head = t.batch_args
        w.line("task = cuda.blockIdx.x")
        w.line("sp = cuda.blockIdx.y")
        w.line(f"n_t = np.int32({dim_expr(t.grid.results[0].type.shape[2])})  # rows of one head")
        w.line(f"n_group = np.int32({dim_expr(dim(t.grid.attrs['kv_repeat']))})  # query heads a key/value head serves")
        w.line("n_rows = np.int32(n_t * n_group)  # the group's rows, head by head")
        k_type = t.masked.k_load.operands[0].type
        w.line(f"n_keys = np.int32({dim_expr(k_type.shape[k_type.rank - 2])})")
        w.line("n_qb = np.int32(1)")
        w.line("qb = np.int32(0)")
        # 32-bit unsigned: a grid's blocks and a batch's axes are fewer than 2^32
        w.line("task32 = np.uint32(task)")
        w.line("n_kv = np.uint32(out_0.shape[1]) // np.uint32(n_group)")
        w.line("bi_0 = task32 // n_kv")
        w.line("h0 = (task32 - bi_0 * n_kv) * np.uint32(n_group)")
        self.names[b], self.names[head] = "bi_0", "h0"
        w.line("i0 = np.int32(0)")
        self.names[t.i0] = "i0"
        for *_, x in self.lane_rows():
            w.line(f"p{x} = np.uint32(min(r{x}, n_rows - 1))")
            w.line(f"g{x} = p{x} // np.uint32(n_t)")
            w.line(f"t{x} = np.int32(p{x} - g{x} * np.uint32(n_t))")

    def packed_query(self) -> None:
        """This lane's A fragments: row ``t{x}`` of head ``h0 + g{x}``, a 32-bit load a register."""
        p, w, atom, load = self.mp, self.w, self.atom, self.t.q_load
        src = self.array_ref(load.operands[0])
        b = self.ref(load.operands[1])
        for x in ROW_NAMES.values():
            w.line(f"q_lane_{x} = {src}[{b}, h0 + g{x}, t{x}, {atom.a.col_term}:]")
        for kc in range(p.head_dim // atom.k):
            for reg, (row, col) in enumerate(atom.a.offsets):
                w.line(f"q_{kc}_{reg} = load_pair16(q_lane_{ROW_NAMES[row]}, {kc * atom.k + col})")

    def row_index(self, x: str) -> str:
        """The output's index of lane row ``x`` (before the feature)."""
        if self.packed:
            return f"{self.names[self.t.batch_args[0]]}, h0 + g{x}, t{x}"
        return super().row_index(x)

    def position_row(self, row: str) -> str:
        """The row a position is computed from for lane row ``row`` (``ra``): packed, its row in its head."""
        return f"t{row[1:]}" if self.packed else row

    def merge_index(self, row: str) -> str:
        """The output's index of merged row ``row`` (a variable, before the feature)."""
        if self.packed:
            b = self.names[self.t.batch_args[0]]
            return f"{b}, h0 + {row} // n_t, {row} - {row} // n_t * n_t"
        return super().merge_index(row)
