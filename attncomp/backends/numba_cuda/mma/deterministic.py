"""The deterministic backward on tensor cores: key-major and query-major kernels with no floating-point atomics.

A grid marked ``deterministic = true`` whose sites are all uniform
(``simt/deterministic_backward.uniform_sites``: ALiBi's ``slopes[h]``, a temperature) runs two
tensor-core kernels of one plan, then the scalar module's ordered sums: f16 and bf16 (kept 16-bit)
with dense rows on the asynchronous-copy design (``mma/flash_backward.py``), float32 on tf32 or
3xTF32 products on the staged one (``mma/backward_kernel.py``):

- the key-major kernel (:class:`DeterministicKeys`): the design's kernel without dQ.  Each key's dK
  and dV belong to one thread block, which stores them (rows of its own query batch position, added
  up in position order by ``_heads`` where several share a key/value head); each lane sums the
  sites' contributions in a register, the block adds its lanes' sums in thread order into its own
  slice, and ``_sites`` adds the slices in block order.
- the query-major dQ kernel ``_dq`` (:class:`QueryMajorDq`): one thread block per ``rows`` query rows
  of an IR query block (``BackwardKernels.dq_pass_plan``: up to D = 64 on the asynchronous-copy
  design 64 rows, with no dK and dV fragments beside its own), its rows (query, output gradient,
  log-sum-exp, delta) staged once; for every key block in order, where the IR's bounds for it
  reach the query block, each ``keys`` keys: their keys and values staged, ``S^T`` and ``dP^T``
  with the key-major kernel's products and elements (the warp's 16 keys on the fragments' rows),
  dS to shared memory and ``dQ += dS K`` into fragments kept in registers for the whole kernel,
  stored once at the end.

Every sum runs in an order the code fixes, so the gradients are the same bits from run to run; the
price is the dQ kernel's second ``S^T`` and ``dP^T`` (seven products a tile where the atomic kernels
make five).  Other deterministic grids run the scalar kernels of ``simt/deterministic_backward.py``.
"""

from __future__ import annotations

from attncomp.backends.backward_tiles import BackwardTile, TiledBackward
from attncomp.backends.numba_cuda.choice import KernelChoice, kernel_line
from attncomp.backends.numba_cuda.mma.atoms import M16N8K16, plus
from attncomp.backends.numba_cuda.mma.backward_kernel import MmaBackwardKernelWriter
from attncomp.backends.numba_cuda.mma.backward_plan import MmaBackwardPlan
from attncomp.backends.numba_cuda.mma.flash_backward import FlashBackwardWriter
from attncomp.backends.numba_cuda.query_major import QueryMajor
from attncomp.backends.numba_cuda.simt.deterministic_backward import block_sums, head_sums_source, site_sums_source
from attncomp.backends.tiles import LoweringError
from attncomp.ir.core import Op, Value


class DeterministicKeys:
    """The key-major kernel of a deterministic tensor-core backward, over a tensor-core writer (see
    the module): no dQ, dK and dV stored, the sites summed in a fixed order."""

    ADDS_DQ = False

    def module_head(self, choice: KernelChoice | None, header: str) -> None:
        """The module's choice lines: the key-major kernel's and its dQ pass's."""
        dq = kernel_line(choice.dq() if choice is not None else None)
        super().module_head(choice, "\n".join([*dq, header]))

    def shared_arrays(self) -> None:
        """The tiles, and the lanes' site sums (:func:`block_sums`)."""
        super().shared_arrays()
        if self.sites:
            self.w.line(f"sums = cuda.shared.array({self.mp.threads}, np.float32)")

    def start_sites(self) -> None:
        super().start_sites()
        self.w.line("blk = cuda.blockIdx.x  # this block's slice of each site")

    def site_add(self, k: int, contribution: str, index: list[str]) -> None:
        """Into the lane's sum: every site's index is the block's (the choice asks for uniform sites)."""
        self.w.line(f"{self.sites[k][1]} += ACC({contribution})")

    def find_uniform_sites(self, gradient: Op, rest: list[Op]) -> None:
        """As the atomic kernel's; every site with an index must be uniform (its lanes' sums go to the
        block's index)."""
        super().find_uniform_sites(gradient, rest)
        if any(rank and k not in self.uniform for k, (rank, _, _) in enumerate(self.sites)):
            raise LoweringError("cuda deterministic backward: a site's index varies within a thread block")

    def key_columns(self) -> tuple[str, str]:
        """The first dK and dV columns of the warp's share, as terms of a sum ("": the first)."""
        return "", ""

    def store(self) -> None:
        """dK and dV into this query batch position's rows (the launch gives each position rows of its
        own where several share a key/value head), each element by one lane; then the sites' sums,
        lane by lane in thread order, into the block's slice."""
        p, w, c = self.mp, self.w, self.atom.c
        batch = ", ".join(self.batch)
        for out, acc in (("out_dk", "dk"), ("out_dv", "dv")):
            w.line(f"{acc}_rows = {out}[{batch}]" if batch else f"{acc}_rows = {out}")
        first_d, first_e = self.key_columns()
        for offset, registers in c.by_row():
            w.line(f"if w16 + {c.row_term} + {offset} < nk:")
            with w.indent():
                w.line(f"key = U(j0 + koff + w16 + {c.row_term}{plus(offset)})")
                for acc, width, first in (("dk", p.d_share, first_d), ("dv", p.e_share, first_e)):
                    # the row from the lane's first column: each store a constant offset from it
                    w.line(f"{acc}_lane = {acc}_rows[key, U({first}{c.col_term}):]")
                    for en in range(width // c.cols):
                        for e in registers:
                            w.line(f"{acc}_lane[{en * c.cols + c.offsets[e][1]}] = {acc}_{en}_{e}")
        block_sums(w, self.sites, set(range(len(self.sites))), p.threads)


class QueryMajorDq(QueryMajor):
    """The query-major dQ kernel of a deterministic tensor-core backward, over a tensor-core writer
    (see the module): its rows staged once (the design's ``stage_rows``), every key block in order,
    dQ in registers.  A design gives :meth:`key_chunk`, :meth:`zero_dq` and :meth:`store_dq`."""

    def zeroed(self, fragment: list[str]) -> None:
        """A dQ fragment's registers at zero, before the key loop."""
        self.w.line(f"{', '.join(fragment)} = {', '.join('ZERO' for _ in fragment)}")

    def key_tile(self, tile: BackwardTile, masked: str | None, hoisted: dict[Op, list[Op]]) -> None:
        """One (query block, key block) tile, ``keys`` keys (``nk`` from ``j0 + koff``) at a time."""
        p, w = self.mp, self.w
        for op in tile.scalar_ops:
            self.scalar().op(op)
        w.line(f"for keys_done in range(0, {p.block_k}, {p.keys}):")
        with w.indent():
            w.line("koff = np.int64(keys_done)")
            w.line(f"nk = min(min({p.keys}, {p.block_k} - koff), n_keys - j0 - koff)")
            w.line("if nk > 0:")
            with w.indent():
                w.line("cuda.syncthreads()  # every warp is done with the previous keys' tiles")
                self.key_chunk(tile, masked, hoisted, f"{self.ref(self.t.k_load.operands[-1])} + koff")

    def write(self, func_name: str) -> str:
        """The kernel function alone (the module's header is the key-major kernel's)."""
        w = self.w
        self.def_line(self.mp.threads)
        with w.indent():
            self.lane_terms()
            self.query_block(self.mp.rows, self.mp.query_parts)
            self.shared_arrays()
            self.stage_rows(self.t.masked)  # the design's: the block's rows, once
            hoisted = self.hoist_regions()
            self.zero_dq()
            self.key_loop(hoisted)
            self.store_dq()
        return w.text()


class FlashDeterministicWriter(DeterministicKeys, FlashBackwardWriter):
    """The key-major kernel on the asynchronous-copy design."""

    def key_columns(self) -> tuple[str, str]:
        return ("wcd + ", "wce + ") if self.mp.split > 1 else ("", "")


class FlashDqWriter(QueryMajorDq, FlashBackwardWriter):
    """The dQ kernel on the asynchronous-copy design: rows and keys by ``cp.async``, operands by
    ``ldmatrix``, each warp its 16-row tiles' ``dq_columns`` (``dq{i}_{n}_{e}``)."""

    def key_chunk(self, tile: BackwardTile, masked: str | None, hoisted: dict[Op, list[Op]], first: str) -> None:
        p, w = self.mp, self.w
        self.stage_keys(first)
        w.line("cp_async_wait(0)")
        w.line("cuda.syncthreads()")
        self.score_products(tile, masked, hoisted)
        w.line("# dS^T -> shared, dQ += dS K")
        self.store_words("ds", "dw")
        w.line("cuda.syncthreads()  # dS seen by every warp")
        for i in range(p.dq_row_tiles):
            self.dq_pass(i * p.warps * M16N8K16.m, range(p.dq_columns // M16N8K16.n), f"dq{i}", add=True)

    def zero_dq(self) -> None:
        p, c = self.mp, self.atom.c
        for i in range(p.dq_row_tiles):
            for n in range(p.dq_columns // c.cols):
                self.zeroed([f"dq{i}_{n}_{e}" for e in range(c.registers)])

    def store_dq(self) -> None:
        """The rows' copies landed (where no key block reached them), then the warp's dQ fragments into
        this block's rows (``dq_rows``, made by ``shared_arrays``), each element by one lane."""
        p, w, c = self.mp, self.w, self.atom.c
        w.line("cp_async_wait(0)")
        for i in range(p.dq_row_tiles):
            for offset, registers in c.by_row():
                w.line(f"row = r0 + dq_row + {c.row_term}{plus(i * p.warps * M16N8K16.m + offset)}")
                w.line("if row < nq:")
                with w.indent():
                    w.line(f"dq_lane = dq_rows[U(i0 + row), U(dq_col + {c.col_term}):]")
                    for n in range(p.dq_columns // c.cols):
                        for e in registers:
                            w.line(f"dq_lane[{n * c.cols + c.offsets[e][1]}] = dq{i}_{n}_{e}")


class StagedDeterministicWriter(DeterministicKeys, MmaBackwardKernelWriter):
    """The key-major kernel on the staged design (float32 operands as tf32, split or not)."""


class StagedDqWriter(QueryMajorDq, MmaBackwardKernelWriter):
    """The dQ kernel on the staged design (``backward_plan.DqPassPlan``: dS beside the query rows):
    each warp ``dq_fragments`` 16 x 8 fragments of the rows' dQ (``dq{i}_{e}``), fragment ``warp + i
    warps`` of the row-major order."""

    def key_chunk(self, tile: BackwardTile, masked: str | None, hoisted: dict[Op, list[Op]], first: str) -> None:
        p, w = self.mp, self.w
        self.stage_keys(first)
        w.line("cuda.syncthreads()")
        w.line("# S^T = K Q^T, dP^T = V dO^T")
        self.transposed_products("s", "k", p.k_pitch, "q", p.head_dim)
        self.transposed_products("ds", "v", p.v_pitch, "o", p.value_dim)
        self.elements(tile, masked, hoisted)
        self.store_ds()
        w.line("cuda.syncthreads()  # dS seen by every warp")
        w.line("# dQ += dS K")
        for i in range(p.dq_fragments):
            w.line(f"m16 = m16_{i}")
            w.line(f"n8 = n8_{i}")
            acc = ", ".join(f"dq{i}_{e}" for e in range(self.atom.c.registers))
            for kk in range(p.keys // self.atom.k):
                self.dq_step(kk, acc, f"dq{i}")

    def zero_dq(self) -> None:
        p, w, atom = self.mp, self.w, self.atom
        per_row = p.d_share // atom.n
        for i in range(p.dq_fragments):
            w.line(f"m16_{i} = ((warp + {i * p.warps}) // {per_row}) * {atom.m}")
            w.line(f"n8_{i} = ((warp + {i * p.warps}) % {per_row}) * {atom.n}")
            self.zeroed([f"dq{i}_{e}" for e in range(atom.c.registers)])

    def store_dq(self) -> None:
        p, w, c = self.mp, self.w, self.atom.c
        batch = ", ".join(self.batch)
        w.line(f"dq_rows = out_dq[{batch}]" if batch else "dq_rows = out_dq")
        for i in range(p.dq_fragments):
            for offset, registers in c.by_row():
                w.line(f"row = r0 + m16_{i} + {c.row_term}{plus(offset)}")
                w.line("if row < nq:")
                with w.indent():
                    w.line(f"dq_lane = dq_rows[U(i0 + row), U(n8_{i} + {c.col_term}):]")
                    for e in registers:
                        w.line(f"dq_lane[{c.offsets[e][1]}] = dq{i}_{e}")


def write_deterministic_mma(
    name: str,
    func_name: str,
    tiled: TiledBackward,
    captured: dict[Value, str],
    dims: list[str],
    plan: MmaBackwardPlan,
    dq_plan: MmaBackwardPlan,
    acc: str,
    pitched: bool = False,
) -> str:
    """The module of a deterministic tensor-core backward of ``plan`` (its design by
    ``choice.async_copies``) and ``dq_plan`` (its dQ pass's, ``BackwardKernels.dq_pass_plan``): the key-major kernel
    ``name``, the dQ kernel ``name_dq``, and the scalar module's sums ``name_heads`` and ``name_sites``;
    ``pitched``: the asynchronous copies read rows a pitch apart (``FlashBackwardWriter.pitched``)."""
    if plan.choice.async_copies:
        keys, dq = FlashDeterministicWriter, FlashDqWriter
    else:
        keys, dq = StagedDeterministicWriter, StagedDqWriter
    kernels = [keys(name, tiled, captured, dims, plan), dq(f"{name}_dq", tiled, captured, dims, dq_plan)]
    for kernel in kernels:
        kernel.pitched = pitched
    sums = [head_sums_source(f"{name}_heads", acc), site_sums_source(f"{name}_sites", acc)]
    return "\n\n".join([kernels[0].write(func_name), kernels[1].write(func_name), *sums])
