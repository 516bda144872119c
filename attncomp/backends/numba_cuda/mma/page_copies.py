"""The asynchronous copies of key and value rows read through a page table (a paged pool).

A paged pool (``ac.page_view``) holds its rows in pages, ``pages[page, heads..., slot, feature]``
(or, FlashAttention's layout, ``pages[page, slot, heads..., feature]``: ``slot = 1``), and row ``j``
of sequence ``b`` is slot ``j % P`` of page ``table[b, j // P]``.  A row's features are dense, so
its 16-byte chunks are copied as a dense array's are: each copy row of ``mma/flash_kernel.py``'s
chunk looks its page up in the table (rows past the last key read the last key's page, and are
zero-filled), then copies from the pool at that page, head and slot (in FlashAttention's layout,
row ``slot * heads + head`` of the page).  The offsets are 64-bit (a pool may hold more than 2^31
elements); a page's rows and the table index are 32-bit unsigned arithmetic.
"""

from __future__ import annotations

from attncomp.backends.numba_cuda.mma.forward_plan import CHUNK_BYTES, COPY_ELEMENTS, swizzled
from attncomp.ir.core import Op
from attncomp.ir.ops.shape import page_slot, rows_before_heads


class PageCopies:
    """The copies of a ``FlashKernelWriter`` whose key or value tiles are read through a page table."""

    def page_lanes(self, name: str, load: Op, view: Op) -> None:
        """The pool, this sequence's table row, a page's rows and elements, and this head's first
        element within a page (``{name}_rows``, ``_table``, ``_size``, ``_page``, ``_head``); in
        FlashAttention's layout, the head's row among a slot's and the rows a slot
        (``_head``, ``_heads``)."""
        w = self.w
        pages, table = self.array_ref(load.operands[0]), self.array_ref(view.operands[1])
        batch, *heads = self.index_refs(load)
        rank = view.operands[0].type.rank
        slot = page_slot(view.attrs, rank)
        w.line(f"{name}_rows = {pages}  # the pool: rows by page, head and slot")
        if name == "v" and self.same_pages(load, view):  # the keys' table and page geometry: kept once
            for part in ("table", "size", "page", "head") + (("heads",) if rows_before_heads(view) else ()):
                w.line(f"v_{part} = k_{part}")
            return
        w.line(f"{name}_table = {table}[{batch}]" if view.operands[1].type.rank == 2 else f"{name}_table = {table}")
        w.line(f"{name}_size = np.uint32({pages}.shape[{slot}])  # rows a page")
        w.line(f"{name}_page = np.int64({' * '.join(f'{pages}.shape[{k}]' for k in range(1, rank))})")
        head_axes = [k for k in range(1, rank - 1) if k != slot]
        head = "np.int64(0)"
        for k, h in zip(head_axes, heads):
            head = f"({head}) * {pages}.shape[{k}] + {h}"
        if rows_before_heads(view):  # a page's rows: slot by slot, each the heads' rows
            w.line(f"{name}_head = np.uint32({head})")
            w.line(f"{name}_heads = np.uint32({' * '.join(f'{pages}.shape[{k}]' for k in head_axes) or '1'})")
            return
        w.line(f"{name}_head = ({head}) * {pages}.shape[{rank - 2}] * {pages}.shape[{rank - 1}]")

    def same_pages(self, v_load: Op, v_view: Op) -> bool:
        """Whether the values' pages are read as the keys' are: one table, the same pages, heads and
        slots, as many features (D = E), the same batch and head indices."""
        k_load = self.t.masked.k_load
        k_view = self.page_view(k_load)
        if k_view is None or k_view.operands[1] is not v_view.operands[1]:
            return False
        same_indices = all(a is b for a, b in zip(k_load.operands[1:-1], v_load.operands[1:-1]))
        same_rows = k_view.operands[0].type.shape[:-1] == v_view.operands[0].type.shape[:-1]
        same_slot = k_view.attrs.get("slot") == v_view.attrs.get("slot")
        return same_indices and same_rows and same_slot and self.mp.head_dim == self.mp.value_dim

    def page_copies(self, name: str, dim: int, jc: str, rows: list[tuple[int, str]]) -> None:
        """The copies of a chunk's rows ``jc + row`` (``rows``: (rows past the thread's first, the
        row)), each from its page; rows past the last key zero-filled from the last key's.  A loop, not
        unrolled, so that one copy's lookup is not kept live beside the others' (fewer spilled bytes
        in the ragged paged kernels, which are at 255 registers)."""
        w = self.w
        step = rows[1][0] if len(rows) > 1 else 0
        view = self.page_view(self.tile_load(name))
        heads_apart = rows_before_heads(view)
        w.line(f"for cn in range({len(rows)}):")
        with w.indent():
            w.line(f"jr = {name}_row + cn * {step}")
            w.line(f"jj = np.int32({jc} + jr)")
            w.line("jp = np.uint32(min(jj, n_keys - 1))")
            w.line(f"pq = jp // {name}_size")
            if heads_apart:  # FlashAttention's layout: the pool's row (page * size + slot) * heads + head
                at = f"np.int64({name}_table[pq]) * {name}_size + (jp - pq * {name}_size)"
                row = f"({at}) * {name}_heads + {name}_head"
                src = f"({row}) * {dim} + {name}_col * {COPY_ELEMENTS}"
            else:
                src = (
                    f"np.int64({name}_table[pq]) * {name}_page + {name}_head"
                    f" + np.int64((jp - pq * {name}_size) * {dim} + {name}_col * {COPY_ELEMENTS})"
                )
            dst = f"jr * {2 * dim} + {swizzled('jr', f'{name}_col')}"
            w.line(f"cp_async16({name}_sh, {dst}, {name}_rows, {src}, select(jj < n_keys, {CHUNK_BYTES}, 0))")
        w.line("cp_async_commit()")
