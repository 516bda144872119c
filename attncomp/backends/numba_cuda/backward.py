"""The backward kernels of one ``ac.key_grid``: one per head-dim pair, made on first use.

As for the forward (``attention.py``), the dk and dv slices a thread keeps
are named registers, so D and E are compile-time constants: the first call
with new head dims generates and compiles that kernel; other sizes never
recompile.  Where the spec's query, key, value and output gradient are one
16-bit type the products run on tensor cores (``mma/backward_kernel.py``),
else on the scalar kernel (``simt/backward_kernel.py``).  The driver zeroes the
outputs (every kernel adds into them) and launches one thread block per
query batch position, IR key block and part of a key block.

A grid marked ``deterministic = true`` runs kernels with no floating-point atomics: a key-major
kernel (dK, dV and the sites' per-block sums), a query-major dQ kernel, the sum of each key/value
head's query positions and of the sites' per-block slices.  On tensor cores
(``mma/deterministic.py``: f16 and bf16 on the asynchronous-copy design, float32 on the staged one)
where every site is uniform and the plan fits, else the scalar kernels of
``simt/deterministic_backward.py``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from attncomp.backends.backward_tiles import read_tiled_backward
from attncomp.backends.cache import load_source
from attncomp.backends.codegen import size_names
from attncomp.backends.numba_cuda.choice import BACKWARD, KernelChoice
from attncomp.backends.numba_cuda.host import arrays, launches
from attncomp.backends.numba_cuda.host.graph_kernel_writer import SCALAR_ARG, array_type, contiguous_at_call
from attncomp.backends.numba_cuda.host.views import transposes_in_place
from attncomp.backends.numba_cuda.mma.backward_kernel import MmaBackwardKernelWriter
from attncomp.backends.numba_cuda.mma.backward_plan import MmaBackwardPlan, plan_mma_backward, staged_dq_plan
from attncomp.backends.numba_cuda.mma.deterministic import write_deterministic_mma
from attncomp.backends.numba_cuda.mma.flash_backward import FlashBackwardWriter
from attncomp.backends.numba_cuda.mma.flash_backward_plan import FlashBackwardPlan, plan_flash_backward, plan_flash_dq
from attncomp.backends.numba_cuda.simt.backward_kernel import write_backward_kernel
from attncomp.backends.numba_cuda.simt.backward_plan import BackwardPlan, plan_backward
from attncomp.backends.numba_cuda.simt.deterministic_backward import (
    site_bytes,
    uniform_sites,
    write_deterministic_backward,
)
from attncomp.backends.numba_cuda.simt.dq_plan import DqPlan, plan_dq
from attncomp.ir.core import Func, Op, captured_values
from attncomp.ir.dims import Dim, dim
from attncomp.ir.types import NUMPY_DTYPES, accumulation_dtype


class BackwardKernels:
    """The kernels of one ``ac.key_grid``: ``choice`` says which (``choice.choose``: tensor cores
    where it names an atom and the head dims fit); ``lanes`` fixes the threads per key of the scalar
    kernel (default: chosen)."""

    def __init__(
        self,
        index: int,
        grid: Op,
        func: Func,
        choice: KernelChoice | None = None,
        lanes: int | None = None,
    ):
        #: arguments read through transposed views (any layout at a call: their signature's arrays)
        self.views = transposes_in_place(func)
        self.index = index
        self.grid = grid
        self.tiled = read_tiled_backward(grid)
        self.captured = {v: f"arg_{n}" for n, v in enumerate(captured_values(grid))}
        self.dims = size_names(func)
        self.func_name = func.name
        self.name = f"attention_backward_kernel_{index}"
        self.lanes = lanes
        #: the kernel the grid asks for (``choice.choose``, made from the IR before ``widen-bf16``,
        #: ``numba_cuda.build``): its atom (None: the scalar kernel), how the device holds the query,
        #: key, value and output gradient ("f16", "bits": bf16 patterns, "f32"), and whether it is
        #: deterministic (no floating-point atomics: ``mma/deterministic.py`` or
        #: ``simt/deterministic_backward.py``); by default the grid's ``deterministic`` on the scalar
        #: kernels
        if choice is None:
            deterministic = bool(grid.attrs.get("deterministic", False))
            choice = KernelChoice(BACKWARD, accumulate=self.acc_dtype, deterministic=deterministic)
        self.choice = choice
        #: the sites a deterministic kernel sums per thread (their index is the block's)
        self.uniform = uniform_sites(self.tiled, self.captured) if self.deterministic else set()
        #: where the query, key, value and output-gradient arrays are in a launch's arguments
        t, names = self.tiled, list(self.captured.values())
        loads = (t.masked.q_load, t.k_load, t.v_load, t.masked.d_out_load)
        self._row_args = [
            len(grid.results) + names.index(self.captured[load.operands[0]])
            for load in loads
            if load.operands[0] in self.captured
        ]
        #: the tile sources read as bf16 bit patterns (query, key, value and output gradient kept 16-bit)
        self.bits = frozenset(load.operands[0] for load in loads if self.choice.storage == "bits")
        self._kernels: dict[tuple[int, int, bool, bool], Any] = {}
        #: the kernel the last launch ran (``choice_for``)
        self.last_choice: KernelChoice | None = None

    @property
    def element(self) -> str | None:
        """The products' kind on tensor cores ("f16", "bf16", "tf32", "3xtf32"; None: the scalar
        kernels), ``KernelChoice.products``."""
        return self.choice.products

    @property
    def storage(self) -> str:
        return self.choice.storage

    @property
    def deterministic(self) -> bool:
        """Sums in an order fixed from run to run (``KernelChoice.deterministic``)."""
        return self.choice.deterministic

    @property
    def head_dims(self) -> tuple[Dim, Dim]:
        """D and E as the IR has them: the last axes of dq and dv."""
        return self.grid.results[0].type.shape[-1], self.grid.results[2].type.shape[-1]

    @property
    def acc_dtype(self) -> str:
        """The element type of the outputs the kernel adds into (float16 results are narrowed after)."""
        return accumulation_dtype(self.grid.results[0].type.dtype)

    @property
    def acc_bytes(self) -> int:
        return np.dtype(NUMPY_DTYPES[self.acc_dtype]).itemsize

    def plan(self, head_dim: int, value_dim: int) -> BackwardPlan:
        """The scalar (key-major) kernel's plan; a deterministic one has room for its sites' sums."""
        t = self.tiled
        if not self.deterministic:
            return plan_backward(t.block_q, t.block_k, head_dim, value_dim, self.acc_bytes, self.lanes)
        staged = site_bytes(t, self.uniform, self.acc_bytes)
        return plan_backward(
            t.block_q, t.block_k, head_dim, value_dim, self.acc_bytes, self.lanes, staged, bool(self.uniform)
        )

    def dq_plan(self, head_dim: int, value_dim: int) -> DqPlan:
        """The plan of a deterministic grid's dQ kernel."""
        return plan_dq(self.tiled.block_q, self.tiled.block_k, head_dim, value_dim, self.acc_bytes)

    def mma_plan(self, head_dim: int, value_dim: int, dense: bool = True) -> MmaBackwardPlan | None:
        """The tensor-core plan for these head dims, if the kernel has one: asynchronous copies where
        the call's rows are ``dense`` and the plan fits (``plan_flash_backward``), else the staged one.
        A deterministic grid's (``mma/deterministic.py``) only where every site is uniform: 16-bit
        operands on the asynchronous-copy plan, float32 on the staged one whose dQ pass fits."""
        t = self.tiled
        flash = plan_flash_backward(t.block_q, t.block_k, head_dim, value_dim, self.choice) if dense else None
        if not self.deterministic:
            return flash or plan_mma_backward(t.block_q, t.block_k, head_dim, value_dim, self.choice)
        if len(self.uniform) < len(t.site_ranks):  # a site indexed per element: thread 0's ordered sum
            return None
        if flash is not None or not self.choice.tf32:
            return flash
        staged = plan_mma_backward(t.block_q, t.block_k, head_dim, value_dim, self.choice)
        return staged if staged is not None and staged_dq_plan(staged) is not None else None

    def dq_pass_plan(self, plan: BackwardPlan | MmaBackwardPlan) -> DqPlan | MmaBackwardPlan:
        """The plan of a deterministic grid's dQ pass beside its key-major kernel's ``plan``: on tensor
        cores, that plan's design (``plan_flash_dq``, ``staged_dq_plan``), else the scalar one."""
        if isinstance(plan, FlashBackwardPlan):
            return plan_flash_dq(plan)
        if isinstance(plan, MmaBackwardPlan):
            found = staged_dq_plan(plan)
            assert found is not None, "mma_plan checks the dQ pass's tiles"
            return found
        return self.dq_plan(plan.head_dim, plan.value_dim)

    def choice_for(self, head_dim: int, value_dim: int, dense: bool = True, pitched: bool = False) -> KernelChoice:
        """The kernel a launch with these head dims (and ``dense`` rows or not; ``pitched``: dense rows
        a pitch apart, the same choice) runs: the grid's choice where its tensor-core plan fits, else
        the scalar kernel."""
        mma = self.mma_plan(head_dim, value_dim, dense or pitched)
        return mma.choice if mma is not None else self.choice.scalar()

    def launch_plan(self, head_dim: int, value_dim: int, dense: bool = True) -> BackwardPlan | MmaBackwardPlan:
        """The plan a launch with these head dims runs: on tensor cores where it can."""
        return self.mma_plan(head_dim, value_dim, dense) or self.plan(head_dim, value_dim)

    def source(self, head_dim: int, value_dim: int, dense: bool = True, pitched: bool = False) -> str:
        """The kernels' source; ``pitched``: the asynchronous copies read rows a pitch apart
        (``FlashBackwardWriter.pitched``: FlashAttention's layout read through transposed views)."""
        mma = self.mma_plan(head_dim, value_dim, dense or pitched)
        parts = (self.tiled, self.captured, self.dims, mma)
        pitched = pitched and mma is not None and mma.choice.async_copies
        if mma is not None and self.deterministic:
            dq = self.dq_pass_plan(mma)
            return write_deterministic_mma(self.name, self.func_name, *parts, dq, self.acc_dtype, pitched)
        if mma is not None:
            writer = FlashBackwardWriter if mma.choice.async_copies else MmaBackwardKernelWriter
            kernel = writer(self.name, *parts)
            kernel.pitched = pitched
            return kernel.write(self.func_name)
        plan, choice = self.plan(head_dim, value_dim), self.choice.scalar()
        if choice.deterministic:
            dq = self.dq_plan(head_dim, value_dim)
            args = (self.tiled, self.captured, self.dims, plan, dq, self.uniform, self.acc_dtype, choice, self.bits)
            return write_deterministic_backward(self.name, self.func_name, *args)
        args = (self.tiled, self.captured, self.dims, plan, choice, self.bits)
        return write_backward_kernel(self.name, self.func_name, *args)

    def signature(self) -> str:
        """The Numba signature the PTX is compiled for (outputs C-contiguous in the accumulation type; a
        deterministic grid's sites are its per-block slices, ``[blocks, *site]``)."""
        acc = self.acc_dtype
        ranks = [max(r.type.rank, 1) for r in self.grid.results]
        if self.deterministic:
            ranks[3:] = [rank + 1 for rank in ranks[3:]]
        types = [array_type(acc, rank, contiguous=True) for rank in ranks]
        for value in self.captured:
            rank = value.type.rank
            # the specialisation a call with C-contiguous arrays dispatches (a transposed view: any layout)
            contiguous = contiguous_at_call(value) and value not in self.views
            if rank == 0:
                types.append(SCALAR_ARG[value.type.dtype])
            else:  # bf16 patterns (a host array's uint16 view) where kept 16-bit
                types.append(array_type(value.type.dtype, rank, contiguous, patterns=value in self.bits))
        types += ["int64"] * len(self.dims)
        return f"void({', '.join(types)})"

    def kernel(self, head_dim: int, value_dim: int, suffix: str = "", dense: bool = True, pitched: bool = False) -> Any:
        """The backward kernel for these head dims, for a call whose rows are ``dense`` or not (or
        ``pitched``: dense rows a pitch apart, ``arrays.pitched_rows``; a deterministic grid's:
        ``suffix`` "_dq" the dQ kernel, "_sites" the sum of the sites' slices)."""
        mma = self.mma_plan(head_dim, value_dim, dense or pitched)
        flash = mma is not None and mma.choice.async_copies
        key = (head_dim, value_dim, flash, flash and pitched)
        if key not in self._kernels:
            self._kernels[key] = load_source(self.source(head_dim, value_dim, dense or pitched, key[3]), "cuda")
        return getattr(self._kernels[key], self.name + suffix)

    def extra_kernels(
        self, head_dim: int, value_dim: int, pitched: bool = False
    ) -> list[tuple[str, Any, str, KernelChoice]]:
        """(suffix, kernel, signature, choice) of the kernels a deterministic grid runs after the
        key-major one: the dQ pass, and the ordered sums (the backward's), for a call with dense rows
        (``pitched``: a pitch apart)."""
        if not self.deterministic:
            return []
        rows, row = array_type(self.acc_dtype, 2, contiguous=True), array_type(self.acc_dtype, 1, contiguous=True)
        choice = self.choice_for(head_dim, value_dim)

        def kernel(suffix: str) -> Any:
            return self.kernel(head_dim, value_dim, suffix, pitched=pitched)

        return [
            ("_dq", kernel("_dq"), self.signature(), choice.dq()),
            ("_heads", kernel("_heads"), f"void({rows}, int64[:, ::1], {rows})", choice),
            ("_sites", kernel("_sites"), f"void({rows}, {row})", choice),
        ]

    @property
    def specialised(self) -> list[tuple[int, int]]:
        """The (D, E) pairs compiled so far."""
        return list(dict.fromkeys(key[:2] for key in self._kernels))

    def launch(self, positions: int, n_keys: int, head_dim: int, value_dim: int, *args: Any) -> None:
        """Add the gradients of ``positions`` query batch positions into the zeroed outputs in ``args``
        (then the captured values and sizes)."""
        if self.deterministic:
            self.launch_deterministic(positions, n_keys, head_dim, value_dim, *args)
            return
        dense, pitched = self.rows_of(args)
        plan = self.launch_plan(head_dim, value_dim, dense)
        self.last_choice = self.choice_for(head_dim, value_dim, dense)
        blocks = positions * (-(-n_keys // plan.block_k)) * plan.parts * plan.halves
        if blocks <= 0:
            return
        launches.launch(self.kernel(head_dim, value_dim, dense=dense, pitched=pitched), blocks, plan.threads, *args)

    def rows_of(self, args: tuple) -> tuple[bool, bool]:
        """Whether a launch's query, key, value and output-gradient rows are dense (rows one after
        another, ``arrays.dense_rows``, or a pitch apart, ``arrays.pitched_rows``: FlashAttention's
        layout read through transposed views), and whether a pitch apart."""
        consecutive = all(arrays.dense_rows(args[n]) for n in self._row_args)
        pitched = not consecutive and all(arrays.pitched_rows(args[n]) for n in self._row_args)
        return consecutive or pitched, pitched

    def launch_deterministic(self, positions: int, n_keys: int, head_dim: int, value_dim: int, *args: Any) -> None:
        """The key-major kernel (each site into a zeroed slice per thread block; dK and dV into scratch
        rows per query batch position where several share a key/value head), the dQ kernel, then the
        sums: of each key/value head's positions, and of the sites' slices, in a fixed order."""
        dense, pitched = self.rows_of(args)
        plan = self.launch_plan(head_dim, value_dim, dense)
        self.last_choice = self.choice_for(head_dim, value_dim, dense)
        dq = self.dq_pass_plan(plan)
        query_parts = dq.query_parts if isinstance(dq, MmaBackwardPlan) else dq.parts
        n_sites = len(self.grid.results) - 3
        outputs, rest = list(args[: 3 + n_sites]), args[3 + n_sites :]
        out_dq, out_dk, out_dv = outputs[:3]
        members = self.head_members(out_dq, out_dk, dict(zip(self.dims, args[len(args) - len(self.dims) :])))
        shared = members.shape[1] > 1
        if shared:  # rows of their own for each query batch position, added up after
            batch = tuple(out_dq.shape)[:-2]
            outputs[1] = arrays.scratch((*batch, *tuple(out_dk.shape)[-2:]), out_dk.dtype)
            outputs[2] = arrays.scratch((*batch, *tuple(out_dv.shape)[-2:]), out_dv.dtype)
        key_blocks = positions * (-(-n_keys // plan.block_k)) * plan.parts
        slices = [arrays.zeros((max(key_blocks, 1), *tuple(site.shape)), self.acc_dtype) for site in outputs[3:]]
        launched = [*outputs[:3], *slices, *rest]
        if key_blocks > 0:
            keys = self.kernel(head_dim, value_dim, dense=dense, pitched=pitched)
            launches.launch(keys, key_blocks, plan.threads, *launched)
        query_blocks = positions * (-(-tuple(out_dq.shape)[-2] // dq.block_q)) * query_parts
        if query_blocks > 0:
            dq_kernel = self.kernel(head_dim, value_dim, "_dq", dense, pitched)
            launches.launch(dq_kernel, query_blocks, dq.threads, *launched)
        if shared and key_blocks > 0:
            heads = self.kernel(head_dim, value_dim, "_heads", dense, pitched)
            table = arrays.from_host(members, members.shape)
            for out, part in ((out_dk, outputs[1]), (out_dv, outputs[2])):
                size = int(out.size) // members.shape[0]
                flat_out, flat_part = out.reshape(members.shape[0], size), part.reshape(positions, size)
                launches.launch_map(heads, int(out.size), flat_part, table, flat_out)
        sums = self.kernel(head_dim, value_dim, "_sites", dense, pitched)
        for site, part in zip(outputs[3:], slices):
            size = int(site.size)
            launches.launch_map(sums, size, part.reshape(part.shape[0], size), site.reshape(size))

    def head_members(self, out_dq: Any, out_dk: Any, env: dict[str, int]) -> np.ndarray:
        """int64 ``[key/value batch positions, members]``: the flat query batch positions of each
        key/value batch position, in increasing order (the IR's mapping: axis 1's head ``h //
        kv_repeat``, 0 along an axis of size 1)."""
        dq_batch, kv_batch = tuple(out_dq.shape)[:-2], tuple(out_dk.shape)[:-2]
        heads = int(np.prod(kv_batch, dtype=np.int64))
        if not dq_batch or 0 in dq_batch:  # no batch axes: one position; no position: none to add
            return np.zeros((heads, 1 if not dq_batch else 0), dtype=np.int64)
        group = dim(self.grid.attrs["kv_repeat"]).evaluate(env)
        index = np.indices(dq_batch).reshape(len(dq_batch), -1)
        kv = [np.zeros_like(x) if kv_batch[a] == 1 else x // group if a == 1 else x for a, x in enumerate(index)]
        order = np.argsort(np.ravel_multi_index(kv, kv_batch), kind="stable")
        return order.reshape(heads, -1).astype(np.int64)
