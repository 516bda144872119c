"""What every graph kernel (``graph_kernels.py``) is written with: the Numba types of arrays and
host scalars, a kernel's parameters (:class:`Param`) and launch (:class:`GraphKernel`), and
:class:`GraphKernelWriter`, the shared pieces of the writers (the grid-stride loop, flat-index
decoding, operand loads under broadcasting)."""

from __future__ import annotations

from dataclasses import dataclass, field

from attncomp.backends.codegen import NUMPY_SCALAR, SourceWriter
from attncomp.backends.scalars import SCALAR_TYPES
from attncomp.ir.core import Op, Value
from attncomp.ir.types import TensorType

#: what a graph kernel reading bf16 patterns imports
WIDEN_IMPORT = "from attncomp.backends.numba_cuda.warp import widen_bf16"

NUMBA_DTYPE = {"f16": "float16", "f32": "float32", "f64": "float64", "i32": "int32", "i64": "int64", "i1": "boolean"}

#: what a host scalar becomes as a kernel argument (see ``scalars.kernel_scalar``)
SCALAR_ARG = {d: NUMBA_DTYPE[t] for d, t in SCALAR_TYPES.items()}


def array_type(dtype: str, rank: int, contiguous: bool = False, patterns: bool = False) -> str:
    """A Numba array type: ``float32[:, ::1]`` (C layout) or ``float32[:, :]`` (any layout);
    ``uint16[...]`` for bf16 held as its 16-bit ``patterns``."""
    axes = [":"] * max(rank, 1)
    if contiguous:
        axes[-1] = "::1"
    return f"{'uint16' if patterns else NUMBA_DTYPE[dtype]}[{', '.join(axes)}]"


def contiguous_at_call(value: Value) -> bool:
    """Whether the driver hands ``value`` to a kernel C-contiguous when the call's arrays are: all but a
    decoder cache's view of its first rows (``ac.cache_append``'s result, ``rt.prefix``).  Kernel
    signatures type such values C-contiguous (``float32[:, ::1]``), the specialisation such a call
    dispatches, so that the PTX compiled from a signature is the launched kernel's."""
    return getattr(value.owner, "name", None) != "ac.cache_append"


def compute_type(dtype: str) -> str:
    """The numpy scalar type a kernel computes ``dtype`` values in (float16 in float32)."""
    return NUMPY_SCALAR[dtype]


def widen(dtype: str, expr: str) -> str:
    """``expr`` (an element of ``dtype``) in its compute type; booleans stay as they are."""
    return expr if dtype == "i1" else f"{compute_type(dtype)}({expr})"


@dataclass
class Param:
    """One kernel parameter, and what the driver passes for it.

    ``kind``: "out" (the result buffer), "array" (a device operand), "scalar"
    (a host 0-d operand), "int" (a size or offset the driver computes), "err"
    (the gather bounds flags).
    """

    name: str
    kind: str
    numba_type: str
    value: Value | None = None
    expr: str = ""


@dataclass
class GraphKernel:
    """A generated kernel and how to launch it.

    ``launch`` is "map" (a 1-d grid over the elements of parameter ``work``,
    less its axis ``work_axis`` for row kernels) or "matmul" (2-d tiles of
    ``out`` times its batch).  ``after`` are driver calls to make after the
    launch, with ``{param}`` standing for the argument passed for ``param``.
    """

    name: str
    source: str
    params: list[Param]
    launch: str
    work: str = "out"
    work_axis: int | None = None
    after: list[str] = field(default_factory=list)
    #: import lines the driver module needs for this kernel (beyond its header's)
    imports: list[str] = field(default_factory=list)

    @property
    def signature(self) -> str:
        return f"void({', '.join(p.numba_type for p in self.params)})"


class GraphKernelWriter:
    """Shared pieces: parameters, the grid-stride loop, flat-index decoding, operand loads."""

    def __init__(
        self,
        name: str,
        op: Op | None,
        out: Value | None = None,
        patterns: frozenset[Value] = frozenset(),
        views: frozenset[Value] = frozenset(),
    ):
        """A kernel computing ``op``'s result (or ``out``, a value of the same type); the operands in
        ``patterns`` are held as bf16 patterns (uint16), widened as they are loaded; those in ``views``
        are transposed views of arguments (``host/views.py``), typed as any layout."""
        self.name = name
        self.patterns = patterns
        self.views = views
        #: whether an operand held as patterns was read (the kernel imports ``widen_bf16``)
        self.read_patterns = False
        self.op = op
        self.w = SourceWriter()
        self.params: list[Param] = []
        self.names: dict[Value, str] = {}
        self.counter = 0
        out = op.results[0] if out is None else out
        self.out_type = out.type
        self.out_rank = out.type.rank
        self.param("out", "out", array_type(out.type.dtype, out.type.rank, contiguous=True), out)

    def fresh(self, hint: str) -> str:
        self.counter += 1
        safe = "".join(ch if ch.isalnum() else "_" for ch in (hint or "t"))
        return f"{safe}_{self.counter}"

    def param(self, name: str, kind: str, numba_type: str, value: Value | None = None, expr: str = "") -> str:
        self.params.append(Param(name, kind, numba_type, value, expr))
        return name

    def operand(self, value: Value) -> str:
        """A parameter for an operand: a device array, or a host scalar."""
        for p in self.params:
            if p.value is value and p.kind in ("array", "scalar"):
                return p.name
        name = f"a{len([p for p in self.params if p.kind in ('array', 'scalar')])}"
        if value.type.rank == 0:
            return self.param(name, "scalar", SCALAR_ARG[value.type.dtype], value)
        patterns = value in self.patterns
        contiguous = contiguous_at_call(value) and value not in self.views
        numba_type = array_type(value.type.dtype, value.type.rank, contiguous, patterns)
        return self.param(name, "array", numba_type, value)

    def start(self, count: str = "out.size", setup: tuple[str, ...] = ()) -> None:
        """The def line (every parameter must be known by now) and the grid-stride loop."""
        self.w.line("@cuda.jit(cache=True)")
        self.w.line(f"def {self.name}({', '.join(p.name for p in self.params)}):")
        self.w.depth += 1
        for line in setup:
            self.w.line(line)
        self.w.line(f"for flat in range(cuda.grid(1), {count}, cuda.gridsize(1)):")
        self.w.depth += 1

    def decode(self, extents: list[str], prefix: str = "i", flat: str = "flat") -> list[str]:
        """Row-major indices of ``flat`` over ``extents``."""
        names = [f"{prefix}{k}" for k in range(len(extents))]
        rest = flat
        for k in reversed(range(len(extents))):
            if k == 0:
                self.w.line(f"{names[k]} = {rest}")
            else:
                self.w.line(f"{names[k]} = {rest} % {extents[k]}")
                self.w.line(f"rest_{k} = {rest} // {extents[k]}")
                rest = f"rest_{k}"
        return names

    def out_index(self) -> list[str]:
        """The output element of this iteration (``[0]`` for a 0-d result)."""
        if self.out_rank == 0:
            return ["0"]
        return self.decode([f"out.shape[{k}]" for k in range(self.out_rank)])

    def broadcast(self, value: Value, index: list[str], into: TensorType) -> list[str]:
        """``value``'s element for output element ``index`` under numpy broadcasting."""
        rank = value.type.rank
        out = []
        for m in range(rank):
            k = into.rank - rank + m
            mine, theirs = value.type.shape[m], into.shape[k]
            stretched = mine.is_const and mine.value == 1 and not (theirs.is_const and theirs.value == 1)
            out.append("0" if stretched else index[k])
        return out

    def load(self, value: Value, index: list[str], into: TensorType | None = None) -> str:
        """A scalar for an operand at element ``index`` of ``into`` (default: the output), broadcast:
        a loaded array element or a host scalar."""
        ref = self.operand(value)
        if value.type.rank == 0:
            return ref
        var = self.fresh("x")
        at = ", ".join(self.broadcast(value, index, self.out_type if into is None else into))
        if value in self.patterns:
            self.read_patterns = True
            self.w.line(f"{var} = widen_bf16({ref}[{at}])")
        else:
            self.w.line(f"{var} = {widen(value.type.dtype, f'{ref}[{at}]')}")
        return var

    def store(self, index: list[str], expr: str) -> None:
        self.w.line(f"out[{', '.join(index)}] = {expr}")

    def finish(
        self,
        launch: str = "map",
        work: str = "out",
        work_axis: int | None = None,
        after: list[str] | None = None,
        imports: list[str] | None = None,
    ) -> GraphKernel:
        return GraphKernel(self.name, self.w.text(), self.params, launch, work, work_axis, after or [], imports or [])


def record_bad_index(w, axis: int, index: str) -> None:
    """Keep the lowest negative and the highest too-large ``index`` of ``axis`` in ``err`` (zeros when
    none), which ``rt.check_indices`` turns into the interpreter's ``IndexError`` after the kernel."""
    w.line(f"if {index} < 0:")
    with w.indent():
        w.line(f"cuda.atomic.min(err, {2 * axis}, {index})")
    w.line("else:")
    with w.indent():
        w.line(f"cuda.atomic.max(err, {2 * axis + 1}, {index})")
