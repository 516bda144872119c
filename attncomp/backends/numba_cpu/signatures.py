"""The Numba types of a kernel's parameters, read from the IR.

Kernels are compiled with explicit signatures: the driver passes every array
C-contiguous in a dtype the IR fixes (``runtime.kernel_array``) and every scalar
as ``runtime.kernel_scalar`` makes it, so the types are known before any call.
Knowing them lets the driver pack its arguments as one tuple whose type the tasks
declare (``launch.unpack``) and call the tasks through a pointer: the tasks' code
is not linked into the driver and optimised again there, which would cost as much
as compiling them.

Arrays the kernel only reads are typed read-only, which also accepts writable
arrays (a read-only memory map, or a Dask chunk, passes as it is).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, replace

from attncomp.backends.codegen import SourceWriter
from attncomp.backends.scalars import SCALAR_TYPES, array_dtype
from attncomp.ir.core import Func, Op, Value, captured_values
from attncomp.ir.types import DTYPES, accumulation_dtype

NUMBA_TYPES = {
    "i1": "types.boolean",
    "i32": "types.int32",
    "i64": "types.int64",
    "f16": "types.float16",
    "bf16": "types.float32",  # what a bf16 value computes in (its stored bits: ELEMENT)
    "f32": "types.float32",
    "f64": "types.float64",
    # an 8-bit cache's codes, the two formats told apart by their Numba type (``tile_math.as_float``)
    "f8e4m3": "types.uint8",
    "f8e5m2": "types.int8",
}

#: a 0-d value as ``runtime.kernel_scalar`` passes it
SCALAR = {d: NUMBA_TYPES[t] for d, t in SCALAR_TYPES.items()}

#: an array element as ``runtime.kernel_array`` passes it (16-bit floats widened, but see ``stored_bf16``)
ELEMENT = {d: NUMBA_TYPES[array_dtype(d)] for d in DTYPES}
ELEMENT["bf16"] = "types.uint16"  # a bf16 tile source's bits (``stored_bf16``); other bf16 arrays are widened

INT = "types.int64"


def array_type(dtype: str, rank: int, readonly: bool = False) -> str:
    flag = ", readonly=True" if readonly else ""
    return f"types.Array({ELEMENT[dtype]}, {rank}, 'C'{flag})"


def tile_sources(grid: Op) -> set[Value]:
    """The values a grid's tiles are loaded from: passed in the accumulation type."""
    return {o.operands[0] for o in grid.regions[0].walk() if o.name == "ac.tile_load"}


def buffer_of(value: Value) -> Value:
    """What the driver passes for ``value``: a page view's pages, else the value (a cache view's
    buffer has the view's type)."""
    owner = value.owner
    if owner is not None and getattr(owner, "name", None) == "ac.page_view":
        return owner.operands[0]
    return value


def transposes_in_place(func: Func) -> dict[Value, tuple[int, ...]]:
    """The ``ac.transpose`` results that kernels read in place, each with its permutation: the
    driver passes the array before the transpose (no copy) and the kernel indexes it with the axes
    permuted (a key tile's rows ``k[b, j0:j0 + nk, h]`` of a ``[B, S, KV, D]`` array read as
    ``[B, KV, S, D]``: FlashAttention's layout).  Only where the last axis stays last (rows keep
    contiguous features), kernels' tile loads read it (a forward kernel copying each tile's rows
    into a work buffer, where its type is the kernel's own: float32 or float64 in a kernel of that
    accumulation type, or bf16 read as bits, widened as its rows are copied; a backward kernel
    multiplying the rows where they are, its array in the accumulation type), and the driver's
    numpy alone reads it otherwise (``READ_AS_VIEWS``: a view, ``np.transpose``, nothing copied:
    the backward's ``delta = sum(d_out * out)``).  Anything else gets the transposed copy."""
    readers: dict[Value, list[Op]] = {}
    for op in func.body.ops:
        for v in [*op.operands, *(captured_values(op) if op.regions else [])]:
            readers.setdefault(v, []).append(op)
    found = {}
    for op in func.body.ops:
        if op.name != "ac.transpose":
            continue
        value, perm = op.results[0], tuple(op.attrs["perm"])
        users = readers.get(value, [])
        if perm[-1] != len(perm) - 1 or value.type.dtype not in ("f32", "f64", "bf16"):
            continue
        grids = [user for user in users if user.name in ("ac.tile_grid", "ac.key_grid")]
        viewed = all(user in grids or user.name in READ_AS_VIEWS for user in users)
        if grids and viewed and all(_only_tiles_of(grid, value) for grid in grids):
            found[value] = perm
    return found


def permuted(index: list[str], perm: tuple[int, ...]) -> list[str]:
    """An index of a transposed value (``index[k]`` of its axis ``k``; axes past the index whole) as
    the index of the array before the transpose, whose axis ``perm[k]`` that is."""
    passed = [":"] * len(perm)
    for k, axis in enumerate(perm[: len(index)]):
        passed[axis] = index[k]
    return passed


#: the driver's numpy ops that read a transpose kernels read in place as a view of the array
READ_AS_VIEWS = {"ac.cast", "ac.mul", "ac.reduce"}


def _only_tiles_of(grid: Op, value: Value) -> bool:
    """Whether ``grid`` reads ``value`` as a tile source only: a backward grid, or a forward one of
    ``value``'s type (or reading it as bf16 bits)."""
    if value in grid.operands:
        return False
    forward_type = accumulation_dtype(grid.results[0].type.dtype) == value.type.dtype or value in stored_bf16(grid)
    if grid.name == "ac.tile_grid" and not forward_type:
        return False
    for op in grid.regions[0].walk():
        if value in op.operands and (op.name != "ac.tile_load" or op.operands.index(value) != 0):
            return False
    return True


def stored_bf16(grid: Op) -> set[Value]:
    """The tile sources a forward kernel reads as bf16 bits, widening each tile as it loads it:
    keys, values and a decoder's cache are streamed at half the bytes of float32."""
    if grid.name != "ac.tile_grid":
        return set()
    return {v for v in tile_sources(grid) if v.type.dtype == "bf16" and quantized_cache(v) is None}


def quantized_cache(value: Value) -> Op | None:
    """The ``ac.cache_append`` to an 8-bit cache, or the ``ac.page_view`` of 8-bit pages (each with
    its scales), whose view ``value`` is, or None.  Its first operand holds the codes."""
    owner = value.owner
    if getattr(owner, "name", None) in ("ac.cache_append", "ac.page_view") and len(owner.operands) == 3:
        return owner
    return None


def quantized_scales(value: Value) -> Value:
    """The row scales of the 8-bit cache or pages whose view ``value`` is (:func:`quantized_cache`)."""
    owner = quantized_cache(value)
    return owner.operands[2] if owner.name == "ac.page_view" else owner.operands[1]


def stored_f8(grid: Op) -> set[Value]:
    """The tile sources a forward kernel reads as 8-bit codes, with their rows' scales: an 8-bit
    cache's views (``ir.quantized``), streamed at a quarter of the bytes of float32."""
    if grid.name != "ac.tile_grid":
        return set()
    return {v for v in tile_sources(grid) if quantized_cache(v) is not None}


def argument_dtype(value: Value, grid: Op, acc: str) -> str:
    """The IR dtype of the array passed for captured ``value`` of ``grid``: ``acc`` for tile
    sources (bf16 ones of a forward kernel as they are stored, an 8-bit cache's views as its
    codes), floats widened otherwise."""
    if value in stored_bf16(grid):
        return "bf16"
    if value in stored_f8(grid):
        return quantized_cache(value).operands[0].type.dtype
    if value in tile_sources(grid):
        return acc
    return array_dtype(value.type.dtype)


def captured_types(grid: Op, captured: dict[Value, str], acc: str) -> list[str]:
    """The type of each captured value's parameter, in ``captured``'s order."""
    types = []
    for value in captured:
        if value.type.rank == 0:
            types.append(SCALAR[value.type.dtype])
        else:
            buffer = buffer_of(value)
            types.append(array_type(argument_dtype(value, grid, acc), buffer.type.rank, readonly=True))
    return types


# The lines a kernel writer emits around its task functions ---------------------------------
@contextlib.contextmanager
def packed_task(
    w: SourceWriter, jit: Jit, kernel: str, function: str, worker: str, values: str, arg_types: list[str]
) -> Iterator[str]:
    """``KERNEL_PACK = types.Tuple(...)`` (``arg_types``: the arguments a driver hands its tasks),
    then the task ``function(worker, n_workers, merging, pack_at)`` of ``launch.TASK``'s signature,
    its body indented under this block from ``values, = unpack(pack_at, KERNEL_PACK)`` on.  Yields
    the pack's name, for the driver's :func:`write_pack`."""
    pack = f"{kernel.upper()}_PACK"
    w.line(f"{pack} = types.Tuple(({', '.join(arg_types)},))")
    w.line()
    w.line()
    w.line(str(jit.typed("TASK")))
    w.line(f"def {function}({worker}, n_workers, merging, pack_at):")
    with w.indent():
        w.line(f"{values}, = unpack(pack_at, {pack})")
        yield pack
    w.line()
    w.line()


def write_pack(w: SourceWriter, pack: str, values: str) -> None:
    """The driver's ``pack_at``: the address of ``values`` packed as ``pack`` on its stack
    (``launch.pack_address``), for its tasks; ``keep_alive(pack)`` after their last call."""
    w.line(f"pack = ({values},)")
    w.line(f"pack_at = pack_address(pack, {pack})")


def declare_addresses(w: SourceWriter, kernel: str, tasks: list[str]) -> None:
    """``KERNEL_TASKS``: the tasks' addresses, which the generated driver passes to the kernel."""
    w.line()
    w.line()
    w.line(f"{kernel.upper()}_TASKS = rt.task_addresses(TASK, {', '.join(tasks)})")


@dataclass(frozen=True)
class Jit:
    """An ``@njit`` decorator as data: written from its signature and options, never edited as text.

    Every kernel function is compiled with an explicit signature: the task functions and the
    driver that runs them (``launch.launch``, compiled once, is the parallel part).
    """

    signature: str | None = None
    #: the options every kernel function takes (``FASTMATH`` is a constant of the generated module).
    #: NumPy's error model: a division by zero gives inf or nan, as in NumPy and the interpreter,
    #: rather than a check that raises, whose exit would keep the loop around it from vectorising.
    options: tuple[str, ...] = ("fastmath=set(FASTMATH)", "error_model='numpy'", "cache=True", "nogil=True")

    def typed(self, signature: str) -> Jit:
        """This decorator with ``signature``."""
        return replace(self, signature=signature)

    def __str__(self) -> str:
        args = [self.signature] if self.signature else []
        return f"@njit({', '.join([*args, *self.options])})"
