"""The attention kernels of one ``ac.tile_grid``: one per head-dim pair, made on first use.

A kernel keeps its query and accumulator slices in named registers, so the
head dims D and E are compile-time constants: the first call with new head
dims generates and compiles that kernel (the source is cached on disk by its
text, and Numba caches the compiled kernel beside it); other sizes (batch,
heads, sequence lengths) never recompile, except that calls with fewer
query rows than a block (decoding) get a kernel whose thread blocks hold
just those rows (``plan.rows_for``).

A launch with fewer thread blocks than the GPU holds at once splits the
keys (flash-decoding, see ``simt/forward_kernel.py``): ``split_for`` picks the number of
parts, the attention kernel writes partial states into scratch arrays, and
each unit's last part to finish merges them, in the same launch.  A batch-invariant grid
(``key_split``) splits at fixed key positions whatever the launch (``backends/key_splits.py``).
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from attncomp.backends.cache import load_source
from attncomp.backends.codegen import size_names
from attncomp.backends.key_splits import fixed_split_count, split_blocks
from attncomp.backends.numba_cuda.choice import FORWARD, KernelChoice
from attncomp.backends.numba_cuda.fp8_codes import codes_of, quantized_append, quantized_pages
from attncomp.backends.numba_cuda.host import arrays, launches
from attncomp.backends.numba_cuda.host.graph_kernel_writer import SCALAR_ARG, array_type, contiguous_at_call
from attncomp.backends.numba_cuda.host.quantized_append import codes_type
from attncomp.backends.numba_cuda.host.scratch import Scratch
from attncomp.backends.numba_cuda.host.views import outputs_in_place, transposes_in_place
from attncomp.backends.numba_cuda.kernel_source import threads_constant
from attncomp.backends.numba_cuda.mma.flash_kernel import FlashKernelWriter
from attncomp.backends.numba_cuda.mma.forward_kernel import MmaKernelWriter
from attncomp.backends.numba_cuda.mma.forward_plan import MASK_OPS, WARP_ROWS, MmaPlan, plan_flash, plan_mma
from attncomp.backends.numba_cuda.mma.packed_heads import packed_head
from attncomp.backends.numba_cuda.simt.forward_kernel import write_attention_kernel
from attncomp.backends.numba_cuda.simt.forward_plan import AttentionPlan, plan_attention, rows_for
from attncomp.backends.tiles import read_tiled_attention
from attncomp.ir.core import Func, Op, captured_values
from attncomp.ir.dims import Dim, dim
from attncomp.ir.types import NUMPY_DTYPES, accumulation_dtype

#: the most parts one unit's keys are split into
MAX_SPLIT = 64


class AttentionKernels:
    """The kernels of one ``ac.tile_grid``.  ``lanes`` fixes the threads per query row and
    ``split`` the number of key splits (capped by the key blocks); by default both are chosen."""

    def __init__(
        self,
        index: int,
        grid: Op,
        func: Func,
        choice: KernelChoice | None = None,
        lanes: int | None = None,
        split: int | None = None,
        out_bits: bool = False,
    ):
        self.index = index
        self.grid = grid
        #: arguments read through transposed views (any layout at a call: their signature's arrays)
        self.views = transposes_in_place(func)
        #: whether the output is written through a transposed view of the function's result
        self.out_view = grid.results[0] in outputs_in_place(func)
        self.tiled = read_tiled_attention(grid)
        self.captured: dict = {}
        for n, v in enumerate(captured_values(grid)):
            self.captured[v] = f"arg_{n}"
            if v.owner is not None and getattr(v.owner, "name", None) == "ac.page_view":
                self.captured.setdefault(v.owner.operands[1], f"arg_{n}_table")  # tiles read pages through it
            if quantized_append(v) is not None:  # an 8-bit cache's codes, read with their rows' scales
                self.captured.setdefault(v.owner.operands[1], f"arg_{n}_scale")
            if quantized_pages(v) is not None:  # 8-bit pages: their rows' scales, the pages' layout
                self.captured.setdefault(v.owner.operands[2], f"arg_{n}_scale")
        self.dims = size_names(func)
        self.func_name = func.name
        self.name = f"attention_kernel_{index}"
        self.lanes = lanes
        self.split = split
        #: the kernel the grid asks for (``choice.choose``: made from the IR before ``widen-bf16``,
        #: ``numba_cuda.build``), on tensor cores where the head dims fit (:meth:`choice_for`); by
        #: default the scalar kernel on float32
        self.choice = choice if choice is not None else KernelChoice(FORWARD, accumulate=self.acc_dtype)
        #: the output (a bf16 result of the function) is written as its 16-bit patterns, rounded
        #: to nearest even in the kernel: half the bytes, and no rounding pass after
        self.out_bits = out_bits
        t = self.tiled
        #: the tile sources read as bf16 bit patterns (query, key and value kept 16-bit)
        self.bits = frozenset(
            load.operands[0] for load in (t.q_load, t.masked.k_load, t.masked.v_load) if self.choice.storage == "bits"
        )
        #: where the query, key and value arrays are in a launch's arguments (after the outputs)
        loads = (self.tiled.q_load, self.tiled.masked.k_load, self.tiled.masked.v_load)
        names = list(self.captured.values())
        self._qkv_args = [
            self.n_outs + names.index(self.captured[load.operands[0]])
            for load in loads
            if load.operands[0] in self.captured
        ]
        #: the grid's head index where a decode step can pack the rows of the query heads sharing a
        #: key/value head into one tile (``packed_heads.packed_head``), else None
        self.packable = packed_head(t)
        #: the key splits of the last launch (1: none)
        self.last_split = 1
        #: the kernel of the last launch (``choice_for`` of its head dims, rows and dense or strided rows)
        self.last_choice: KernelChoice | None = None
        self._kernels: dict[tuple, Any] = {}
        self._plans: dict[tuple, MmaPlan | None] = {}  # mma_plan's answers: a launch asks several times
        #: flash-decoding's partial states and split counts, kept from launch to launch
        self.scratch = Scratch()
        self._launching = threading.Lock()  # one launch at a time over the scratch buffers

    @property
    def element(self) -> str | None:
        """The products' kind the grid asks for on tensor cores ("f16", "bf16", "tf32", "3xtf32"; None:
        the scalar kernels), ``KernelChoice.products``."""
        return self.choice.products

    @property
    def storage(self) -> str:
        """How the device holds query, key and value ("f32", "f16", "bits"), ``KernelChoice.storage``."""
        return self.choice.storage

    @property
    def head_dims(self) -> tuple[Dim, Dim]:
        """D and E as the IR has them: the query tile's and the value tile's last axes."""
        return self.tiled.q_load.results[0].type.shape[-1], self.tiled.masked.v_load.results[0].type.shape[-1]

    @property
    def acc_dtype(self) -> str:
        return accumulation_dtype(self.grid.results[0].type.dtype)

    @property
    def n_outs(self) -> int:
        return len(self.grid.results)

    def plan(self, head_dim: int, value_dim: int, rows: int | None = None) -> AttentionPlan:
        acc_bytes = np.dtype(NUMPY_DTYPES[self.acc_dtype]).itemsize
        t = self.tiled
        return plan_attention(t.block_q, t.block_k, head_dim, value_dim, acc_bytes, self.lanes, rows)

    @property
    def score_work(self) -> str:
        """What the score and mask regions do per element (``forward_plan.FLASH_SHAPES``): "positional"
        where the score reads the query or key position (ALiBi, a relative bias) or a weight region
        does (dropout), "elementwise" where it
        does more than scale the product (soft-capping) or the mask more than ``MASK_OPS`` compares and
        arithmetic, or gathers (``forward_plan.MASK_OPS``: a sliding window, documents), else "scale"."""
        region = self.tiled.masked.score.regions[0]
        positions = region.args[:-1]
        if any(x is p for op in region.ops for x in op.operands for p in positions) or self.tiled.weighted:
            return "positional"  # a weight (dropout's hash) reads the positions of every element too
        mask = self.tiled.masked.mask
        ops = [op.name for op in mask.regions[0].ops if op.name != "ac.yield"] if mask is not None else []
        if len(ops) > MASK_OPS or "ac.gather" in ops:
            return "elementwise"
        return "scale" if [op.name for op in region.ops] in (["ac.yield"], ["ac.mul", "ac.yield"]) else "elementwise"

    def group_of(self, args: tuple[Any, ...]) -> int:
        """Query heads per key/value head of a launch (``kv_repeat`` at its sizes, the last of ``args``)."""
        sizes = args[self.n_outs + len(self.captured) :]
        return dim(self.grid.attrs["kv_repeat"]).evaluate(dict(zip(self.dims, (int(x) for x in sizes))))

    def mma_plan(
        self,
        head_dim: int,
        value_dim: int,
        rows: int | None = None,
        dense: bool = True,
        splits: bool = True,
        packed: bool = False,
    ) -> MmaPlan | None:
        """The tensor-core plan of a launch with these head dims and rows per block, if it has one:
        asynchronous copies where the call's query, key and value rows are ``dense`` and the plan fits
        (``plan_flash``; without key splits where ``splits`` is False and the grid's splits are not
        fixed), else the staged one.  ``packed``: rows of grouped heads (:meth:`packed_rows`), on
        the asynchronous copies only."""
        key = (head_dim, value_dim, rows, dense, splits, packed)
        if key not in self._plans:
            self._plans[key] = self._mma_plan(*key)
        return self._plans[key]

    def _mma_plan(
        self, head_dim: int, value_dim: int, rows: int | None, dense: bool, splits: bool, packed: bool
    ) -> MmaPlan | None:
        t = self.tiled
        rows = t.block_q if rows is None else rows
        if dense:
            splits = splits or split_blocks(self.grid, t.block_k) is not None
            work = self.score_work
            flash = plan_flash(t.block_q, t.block_k, head_dim, value_dim, self.choice, rows, splits, work, packed)
            if flash is not None or packed:
                return flash
        return None if packed else plan_mma(t.block_q, t.block_k, head_dim, value_dim, self.choice, rows)

    def packed_rows(self, n_rows: int, group: int, head_dim: int, value_dim: int, dense: bool = True) -> int | None:
        """Rows per block of a launch of ``n_rows`` rows a head that packs its ``group`` query heads
        sharing a key/value head into tensor-core tiles (``mma/packed_heads.py``), or None where it
        does not: a decode step (fewer rows than a tile) of a grid whose heads can be packed, the
        group's rows within a query block, and an asynchronous-copy plan for them."""
        t = self.tiled
        if self.packable is None or group <= 1 or n_rows >= WARP_ROWS or n_rows * group > t.block_q:
            return None
        rows = max(WARP_ROWS, rows_for(t.block_q, n_rows * group))
        return rows if self.mma_plan(head_dim, value_dim, rows, dense, packed=True) is not None else None

    def choice_for(
        self,
        head_dim: int,
        value_dim: int,
        rows: int | None = None,
        dense: bool = True,
        splits: bool = True,
        packed: bool = False,
        pitched: bool = False,
    ) -> KernelChoice:
        """The kernel a launch with these head dims and rows per block runs: the grid's choice where
        its tensor-core plan fits, else the scalar kernel (rows a pitch apart, ``pitched``, or not: the
        same choice)."""
        mma = self.mma_plan(head_dim, value_dim, rows, dense, splits, packed)
        return mma.choice if mma is not None else self.choice.scalar()

    def extra_kernels(
        self, head_dim: int, value_dim: int, pitched: bool = False
    ) -> list[tuple[str, Any, str, KernelChoice]]:
        """None: one kernel per launch (``BackwardKernels.extra_kernels``)."""
        return []

    def threads(
        self, head_dim: int, value_dim: int, rows: int | None = None, dense: bool = True, packed: bool = False
    ) -> int:
        """Threads per block of the kernel for these head dims and rows."""
        mma = self.mma_plan(head_dim, value_dim, rows, dense, packed=packed)
        return mma.threads if mma is not None else self.plan(head_dim, value_dim, rows).threads

    def source(
        self,
        head_dim: int,
        value_dim: int,
        rows: int | None = None,
        dense: bool = True,
        splits: bool = True,
        packed: bool = False,
        pitched: bool = False,
    ) -> str:
        """The kernel's source: on tensor cores where the plan allows, else the scalar kernel;
        ``pitched``: the asynchronous copies read rows a pitch apart (``FlashKernelWriter.pitched``)."""
        args = (self.name, self.func_name, self.tiled, self.captured, self.dims)
        mma = self.mma_plan(head_dim, value_dim, rows, dense, splits, packed)
        if mma is not None:
            writer = FlashKernelWriter if mma.async_copies else MmaKernelWriter
            kernel = writer(self.name, self.tiled, self.captured, self.dims, mma, self.out_bits)
            kernel.pitched = pitched and mma.async_copies
            return kernel.write(self.func_name)
        plan, choice = self.plan(head_dim, value_dim, rows), self.choice.scalar()
        return write_attention_kernel(*args, plan, self.bits, self.out_bits, choice)

    def signature(self) -> str:
        """The Numba signature the PTX is compiled for: the specialisation a call with C-contiguous
        arrays dispatches (``contiguous_at_call``: a decoder's cache views are of any layout)."""
        types = [array_type(r.type.dtype, r.type.rank, contiguous=True) for r in self.grid.results]
        out_rank = self.grid.results[0].type.rank
        types[0] = array_type(self.grid.results[0].type.dtype, out_rank, contiguous=not self.out_view)
        if self.out_bits:
            types[0] = array_type("f32", out_rank, contiguous=not self.out_view, patterns=True)
        for value in self.captured:
            rank = value.type.rank
            contiguous = contiguous_at_call(value) and value not in self.views
            if value in self.bits:  # bf16 patterns (a host array's uint16 view)
                types.append(array_type("f32", rank, contiguous, patterns=True))
            elif codes_of(value) is not None:  # 8-bit codes (a cache's or pages'), as bytes
                types.append(codes_type(rank, contiguous))
            else:
                scalar = SCALAR_ARG[value.type.dtype]
                types.append(scalar if rank == 0 else array_type(value.type.dtype, rank, contiguous))
        types += ["int64"] * len(self.dims)
        acc = self.acc_dtype
        types += ["int64", array_type(acc, 3, True), array_type(acc, 2, True), array_type(acc, 2, True)]
        types.append("int32[::1]")  # each unit's count of finished splits (``simt/forward_kernel.py``'s merge)
        return f"void({', '.join(types)})"

    def kernel(
        self,
        head_dim: int,
        value_dim: int,
        rows: int | None = None,
        dense: bool = True,
        splits: bool = True,
        packed: bool = False,
        pitched: bool = False,
    ) -> Any:
        """The attention kernel for these head dims (and query rows per thread block), for a call
        whose query, key and value rows are ``dense`` or not (``arrays.dense_rows``; ``pitched``: a
        pitch apart, ``arrays.pitched_rows``), with key splits or not (``splits``: one split where
        False and the flash kernel runs), with grouped heads' rows ``packed`` into its tiles or not
        (:meth:`packed_rows`)."""
        return self.launchable(head_dim, value_dim, rows, dense, splits, packed, pitched)[0]

    def launchable(
        self,
        head_dim: int,
        value_dim: int,
        rows: int | None,
        dense: bool,
        splits: bool,
        packed: bool,
        pitched: bool = False,
    ) -> tuple[Any, int]:
        """:meth:`kernel` and the threads a block its module says it is written for (``threads_constant``);
        ``pitched``: dense rows a pitch apart, not one after another (``arrays.pitched_rows``)."""
        rows = self.tiled.block_q if rows is None else rows
        # dense rows make a kernel of their own only where they get the asynchronous copies, and one
        # split only there too
        plan = self.mma_plan(head_dim, value_dim, rows, dense, splits, packed)
        flash = plan is not None and plan.async_copies
        pitched = flash and pitched and not packed
        key = (head_dim, value_dim, rows, flash, not flash or plan.choice.key_splits, packed, pitched)
        if key not in self._kernels:
            self._kernels[key] = load_source(self.source(*key), "cuda")
        module = self._kernels[key]
        return getattr(module, self.name), getattr(module, threads_constant(self.name))

    @property
    def specialised(self) -> list[tuple[int, int]]:
        """The (D, E) pairs compiled so far."""
        return list(dict.fromkeys((d, e) for d, e, _ in self.specialisations))

    @property
    def specialisations(self) -> list[tuple[int, int, int]]:
        """The kernels generated so far, by (D, E, query rows per thread block): one per head dims
        for calls of a block's rows or more, and one per power of two below that (``rows_for``); a
        call with strided keys or values may add a second of the same sizes (:meth:`kernel`)."""
        return list(dict.fromkeys(key[:3] for key in self._kernels))

    def split_for(self, blocks: int, n_keys: int, threads: int, value_dim: int) -> int:
        """Key splits for a launch of ``blocks`` thread blocks over ``n_keys`` keys: a batch-invariant
        grid's parts at fixed key positions (as many as its longest row needs, whatever ``split``
        asks); otherwise enough to fill the GPU."""
        fixed = split_blocks(self.grid, self.tiled.block_k)
        if fixed is not None:
            return fixed_split_count(n_keys, self.tiled.block_k, fixed)
        key_blocks = -(-n_keys // self.tiled.block_k)
        if self.split is not None:
            wanted = self.split
        else:
            target = launches.resident_blocks(threads)
            if blocks >= target:
                return 1
            wanted = -(-target // blocks)
        if value_dim == 0:
            return 1
        return max(1, min(wanted, MAX_SPLIT, key_blocks))

    def launch(self, blocks: int, n_rows: int, n_keys: int, head_dim: int, value_dim: int, *args: Any) -> None:
        """Run the attention of one ``ac.tile_grid``: ``args`` are the kernel's outputs, captured
        values and sizes; ``blocks`` the (batch, query block) units."""
        if blocks <= 0:
            return
        consecutive = all(arrays.dense_rows(args[n]) for n in self._qkv_args)
        # rows a pitch apart (FlashAttention's layout) take the asynchronous copies too, not packed heads
        pitched = not consecutive and all(arrays.pitched_rows(args[n]) for n in self._qkv_args)
        dense = consecutive or pitched
        group = self.group_of(args) if self.packable is not None else 1
        rows = self.packed_rows(n_rows, group, head_dim, value_dim, consecutive)
        packed = rows is not None
        if packed:  # a block per (batch position, key/value head): its group's rows
            blocks //= group
        else:
            rows = rows_for(self.tiled.block_q, n_rows)
        # the split count from the block of the kernel with key splits; the launch's block is the one
        # the kernel it launches is written for (one split's plan may have fewer warps: two tiles each)
        n_split = self.split_for(blocks, n_keys, self.threads(head_dim, value_dim, rows, dense, packed), value_dim)
        self.last_split = n_split
        self.last_choice = self.choice_for(head_dim, value_dim, rows, dense, n_split > 1, packed)
        kernel, threads = self.launchable(head_dim, value_dim, rows, dense, n_split > 1, packed, pitched)
        outs = args[: self.n_outs]
        dtype = NUMPY_DTYPES[self.acc_dtype]
        with self._launching:
            n_flat = 1
            if n_split > 1:
                n_flat = int(np.prod(tuple(outs[0].shape)[:-1], dtype=np.int64))
            shapes = ((n_split, n_flat, max(value_dim, 1)), (n_split, n_flat), (n_split, n_flat))
            parts = tuple(self.scratch.view(k, shape, dtype) for k, shape in enumerate(shapes))
            done = self.scratch.view(3, (blocks if n_split > 1 else 1,), np.int32, zeroed=True)
            launches.launch(kernel, (blocks, n_split), threads, *args, n_split, *parts, done)
