"""What the CUDA kernel writers (forward and backward) share.

Scalar references with the device math functions; a region's scalar code
split into what is hoisted out of the tile loops and what runs per element;
and the index code of the lane layout (``lanes.py``): the feature a lane's
register holds, batch indices from a flat block index, stores guarded for
the padded features of a last slice, and rows staged into shared memory
(through a page table when the load reads pages; an 8-bit cache's codes decoded and scaled by
their row's scale, ``fp8_codes``).
"""

from __future__ import annotations

from collections.abc import Callable

from attncomp.backends.codegen import NUMPY_SCALAR, KernelSource, ScalarEmitter
from attncomp.backends.numba_cuda.choice import KernelChoice, kernel_line
from attncomp.backends.numba_cuda.device_math import SELECT, TILE_FUNCTIONS
from attncomp.backends.numba_cuda.fp8_codes import DECODE, quantized_append
from attncomp.backends.numba_cuda.host.launches import jit_decorator
from attncomp.backends.tiles import element_expr
from attncomp.ir.core import Block, Op, Value
from attncomp.ir.types import is_float


def split_invariant(block: Block, known: Callable[[Value], bool]) -> tuple[list[Op], list[Op]]:
    """The region's ops computable from ``known`` values alone (hoistable), and the rest, in order."""
    ready: set[Value] = set()
    hoisted, rest = [], []
    for op in block.ops:
        if op.name == "ac.yield":
            continue
        if all(v in ready or known(v) for v in op.operands):
            hoisted.append(op)
            ready.update(op.results)
        else:
            rest.append(op)
    return hoisted, rest


def threads_constant(kernel: str) -> str:
    """The name of the constant holding the threads per block a generated kernel is written for."""
    return f"{kernel.upper()}_THREADS"


class CudaKernelSource(KernelSource):
    """What the CUDA kernel writers (forward and backward) share: scalar references with the
    device math functions, and a region's scalar code split into what is hoisted out of the
    tile loops and what runs per element."""

    functions = TILE_FUNCTIONS
    #: tile sources the device keeps as bf16 bit patterns (``numba_cuda.tensor_core_types``)
    bits: frozenset[Value] = frozenset()

    def __init__(self, captured: dict[Value, str], dims: list[str]):
        super().__init__(captured, dims)
        #: divisors known before the tile loop -> the name of their reciprocal (see :meth:`hoist`)
        self.reciprocals: dict[Value, str] = {}

    def module_head(self, choice: KernelChoice | None, header: str) -> None:
        """A kernel module's first lines: its choice (``KernelChoice.header``), then its header
        (comments and imports) and two blank lines."""
        self.w.lines.extend(kernel_line(choice))
        self.w.lines.extend(header.splitlines())
        self.w.line()
        self.w.line()

    def def_line(self, threads: int) -> None:
        """The kernel's block size as a module constant (``threads_constant``: a launch reads the block
        of the kernel it launches there), its ``cuda.jit`` (launched with ``threads`` per block) and
        its ``def`` line."""
        self.w.line(f"{threads_constant(self.name)} = {threads}")
        self.w.line()
        self.w.line()
        self.w.line(jit_decorator(threads))
        self.w.line(f"def {self.name}({', '.join(self.params())}):")

    def read(self, load: Op, element: str) -> str:
        """An element of a tile load's source as the accumulation type (bf16 patterns widened)."""
        return f"widen_bf16({element})" if load.operands[0] in self.bits else f"ACC({element})"

    def ref(self, value: Value) -> str:
        return self.scalar().ref(value)

    def scalar(self, integers: str | None = None) -> ScalarEmitter:
        """The emitter of 0-d ops; ``integers``: the type of their integer results (``ScalarEmitter``);
        choices between values by ``select`` (``device_math.IMPORT``), without a branch."""
        return ScalarEmitter(
            self.w, self.names, self.fresh, self.array_ref, self.functions, self.reciprocals, integers, SELECT
        )

    def index_element(self, value: Value, row: str, col: str) -> str:
        """An index tile's element ``[row, col]`` as a scalar expression (``tiles.element_expr``), its
        minima and maxima by ``select``."""
        return element_expr(value, self.names, row, col, SELECT)

    def hoist(self, map_op: Op, n_variant: int) -> list[Op]:
        """Bind the region's batch arguments, emit its position-independent ops; return the others."""
        region = map_op.regions[0]
        n_batch = len(region.args) - n_variant
        for arg, outer in zip(region.args[:n_batch], map_op.operands[:n_batch]):
            self.names[arg] = self.ref(outer)
        # Known before the tile loop: the batch indices, the prologue's scalars, captured arrays.
        hoisted, rest = split_invariant(region, lambda v: v in self.names or v in self.captured)
        for op in hoisted:
            self.scalar().op(op)
        # A float division by a value known before the tile loop becomes a product with its
        # reciprocal (within 1.5 ulp of the quotient): a correctly rounded float32 division is a
        # call on the GPU, whose spilled registers would cost more than the division.
        variant = set(region.args[n_batch:]) | {r for op in rest for r in op.results}
        for op in rest:
            divisor = op.operands[1] if op.name == "ac.div" else None
            dtype = op.results[0].type.dtype
            if divisor is None or not is_float(dtype) or divisor in variant or divisor not in self.names:
                continue
            if divisor not in self.reciprocals:
                name = self.fresh("inv")
                one = NUMPY_SCALAR[dtype]
                self.w.line(f"{name} = {one}(1.0) / {one}({self.ref(divisor)})")
                self.reciprocals[divisor] = name
        return rest

    def hoist_maps(self, maps: dict[Op | None, int]) -> dict[Op, list[Op]]:
        """:meth:`hoist` of each map (by its number of per-element arguments; None: absent)."""
        return {op: self.hoist(op, n) for op, n in maps.items() if op is not None}

    def weight_factor(self, map_op: Op, hoisted: dict[Op, list[Op]], at: list[str]) -> str:
        """The weight region (dropout's) at positions ``at``, as the local ``wv``."""
        (weight,) = self.apply_all(map_op, hoisted[map_op], at)
        self.w.line(f"wv = ACC({weight})")
        return "wv"

    def apply_all(self, map_op: Op, rest: list[Op], variant: list[str]) -> list[str]:
        """Emit the position-dependent ops of a region for one element; return what it yields."""
        region = map_op.regions[0]
        for arg, expr in zip(region.args[len(region.args) - len(variant) :], variant):
            self.names[arg] = expr
        for op in rest:
            self.scalar().op(op)
        return [self.ref(v) for v in region.ops[-1].operands]

    # the lane layout ------------------------------------------------------------
    #: threads per item (query row or key) and threads per block; set by each writer from its plan
    lanes: int
    threads: int

    def feature(self, k: int) -> str:
        """The feature index of this lane's ``k``-th register (lanes interleave)."""
        return f"g + {k * self.lanes}" if self.lanes > 1 else str(k)

    def padded(self, k: int, width: int) -> bool:
        """Whether register ``k`` of a slice over ``width`` features may be past the last one."""
        return (k + 1) * self.lanes > width

    def guarded(self, k: int, width: int, statement: str) -> None:
        """``statement`` for register ``k``, under ``feature < width`` where it may be padding."""
        if not self.padded(k, width):
            self.w.line(statement)
            return
        self.w.line(f"if {self.feature(k)} < {width}:")
        with self.w.indent():
            self.w.line(statement)

    def batch_indices(self, rank: int, flat: str, shape_of: str, prefix: str = "bi", integers: str = "") -> list[str]:
        """Emit the batch indices ``bi_k`` (``{prefix}_k``) of the row-major flat batch index ``flat``
        over the first ``rank`` axes of array ``shape_of``; ``integers``: the type the axes are taken
        in ("np.uint32": 32-bit unsigned divisions, a few instructions each, not a 64-bit division's
        routine with Python's sign fix-ups; "": Numba's)."""
        names = [f"{prefix}_{k}" for k in range(rank)]
        for k in reversed(range(rank)):
            axis = f"{shape_of}.shape[{k}]"
            if integers:
                self.w.line(f"axis_{k} = {integers}({axis})")
                axis = f"axis_{k}"
            self.w.line(f"rest_{k} = {flat}")
            self.w.line(f"{names[k]} = rest_{k} % {axis}")
            flat = f"rest_{k} // {axis}"
        return names

    def slice_of(self, load: Op) -> str:
        """The array a tile load reads (its rows by features), for this block's batch position."""
        src = self.array_ref(load.operands[0])
        prefix = ", ".join(self.index_refs(load))
        return f"{src}[{prefix}]" if prefix else src

    def index_refs(self, load: Op) -> list[str]:
        """A tile load's batch and head indices, named before the loop that uses them: a constant one
        that the IR defines in a loop's body (the one key/value head of multi-query attention) written
        here."""
        for v in load.operands[1:-1]:
            if v not in self.names and getattr(v.owner, "name", None) == "ac.constant":
                self.scalar().op(v.owner)
        return [self.ref(v) for v in load.operands[1:-1]]

    def stage(self, tile: str, load: Op, count: str, first: str, width: int, pitch: int, rows: int) -> None:
        """Copy ``count`` rows from row ``first`` of a tile load's source into a shared tile of
        ``rows`` rows (coalesced); zero the rows past ``count`` and the columns past ``width``.

        Rows read through an ``ac.page_view`` come from the pool: row ``j`` of sequence ``b`` is
        slot ``j % P`` of page ``table[b, j // P]`` (8-bit pages: its codes decoded, times the scale
        at the same place of the scales)."""
        w = self.w
        src = self.array_ref(load.operands[0])
        view = self.page_view(load)
        w.line(f"for e_idx in range(tid, {rows * pitch}, {self.threads}):")
        with w.indent():
            w.line(f"cc = e_idx // {pitch}")
            w.line(f"dd = e_idx - cc * {pitch}")
            cond = f"cc < {count}" if width == pitch else f"cc < {count} and dd < {width}"
            if view is None:
                prefix = "".join(f"{self.ref(v)}, " for v in load.operands[1:-1])
                element = self.read(load, f"{src}[{prefix}{first} + cc, dd]")
                append = quantized_append(load.operands[0])
                if append is not None:  # an 8-bit cache: the code decoded, times its row's scale
                    code = f"{DECODE[append.operands[0].type.dtype]}({src}[{prefix}{first} + cc, dd])"
                    element = f"{code} * {self.array_ref(append.operands[1])}[{prefix}{first} + cc]"
                w.line(f"{tile}[cc, dd] = {element} if {cond} else ACC(0.0)")
                return
            page, at = self.page_row(load, view, f"{first} + cc")
            w.line(f"if {cond}:")
            with w.indent():
                w.line(f"page = {page}")
                element = self.read(load, f"{src}[page, {at}dd]")
                if len(view.operands) == 3:  # 8-bit pages: the code decoded, times its row's scale
                    code = f"{DECODE[view.operands[0].type.dtype]}({src}[page, {at}dd])"
                    element = f"{code} * {self.array_ref(view.operands[2])}[page, {at.removesuffix(', ')}]"
                w.line(f"{tile}[cc, dd] = {element}")
            w.line("else:")
            with w.indent():
                w.line(f"{tile}[cc, dd] = ACC(0.0)")
