"""CUDA kernels for the ops outside tiled attention, generated one per op.

Projections, norms, rotary embeddings and every op of an unfused graph run
on the device, each as a small ``numba.cuda.jit`` kernel written from the
op's types (ranks and broadcasting are static; sizes are read from the
arrays, so kernels are shape-generic):

- **map** kernels (elementwise ops, ``where``, ``cast``, ``iota``, tensor
  constants, ``gather``, and the layout ops ``transpose``, ``slice``,
  ``repeat_kv``, ``concat``, ``cache_append``, a reshape copy): one element
  per iteration of a grid-stride loop.  The element's scalar code is the
  same :class:`ScalarEmitter` output the attention kernels use.
- **row** kernels (``reduce``, ``softmax``, ``logsumexp``, ``block_reduce``):
  one output element (or row) per iteration, the reduced axes looped over.
- **matmul**: 16 x 16 tiles of both operands staged in shared memory.

A 0-d result of a device op is written to a one-element array the driver
reads back: 0-d values live on the host.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from attncomp.backends.codegen import NUMPY_SCALAR, ScalarEmitter, SourceWriter, dim_expr, literal
from attncomp.backends.numba_cuda.device_math import FUNCTIONS
from attncomp.backends.numba_cuda.runtime import MATMUL_TILE
from attncomp.backends.scalars import SCALAR_TYPES
from attncomp.backends.tiles import LoweringError
from attncomp.ir.core import Op, Value
from attncomp.ir.dims import dim
from attncomp.ir.types import TensorType, accumulation_dtype, is_float

NUMBA_DTYPE = {"f16": "float16", "f32": "float32", "f64": "float64", "i32": "int32", "i64": "int64", "i1": "boolean"}

#: what a host scalar becomes as a kernel argument (see runtime.kernel_scalar)
SCALAR_ARG = {d: NUMBA_DTYPE[t] for d, t in SCALAR_TYPES.items()}

ELEMENTWISE = {
    "ac.neg",
    "ac.abs",
    "ac.exp",
    "ac.log",
    "ac.tanh",
    "ac.sqrt",
    "ac.rsqrt",
    "ac.sin",
    "ac.cos",
    "ac.not",
    "ac.add",
    "ac.sub",
    "ac.mul",
    "ac.div",
    "ac.floordiv",
    "ac.mod",
    "ac.pow",
    "ac.maximum",
    "ac.minimum",
    "ac.and",
    "ac.or",
    "ac.cmp",
    "ac.where",
    "ac.cast",
    "ac.constant",
    "ac.iota",
    "ac.gather",
}
LAYOUT = {"ac.transpose", "ac.slice", "ac.repeat_kv", "ac.concat", "ac.cache_append"}
ROWS = {"ac.reduce", "ac.softmax", "ac.logsumexp", "ac.block_reduce"}


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


class _Writer:
    """Shared pieces: parameters, the grid-stride loop, flat-index decoding, operand loads."""

    def __init__(self, name: str, op: Op | None, out: Value | None = None):
        """A kernel computing ``op``'s result (or ``out``, a value of the same type)."""
        self.name = name
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
        numba_type = array_type(value.type.dtype, value.type.rank, contiguous_at_call(value))
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

    def load(self, value: Value, index: list[str]) -> str:
        """A scalar for an operand at the output element: a loaded array element or a host scalar."""
        ref = self.operand(value)
        if value.type.rank == 0:
            return ref
        var = self.fresh("x")
        at = ", ".join(self.broadcast(value, index, self.out_type))
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


def _elementwise(name: str, op: Op) -> GraphKernel:
    k = _Writer(name, op)
    for value in op.operands:
        k.operand(value)
    if op.name == "ac.gather":
        k.param("err", "err", "int64[::1]")
    k.start()
    index = k.out_index()
    out = op.results[0]
    dtype = out.type.dtype
    if op.name == "ac.iota":
        expr = f"np.int64({index[op.attrs['axis']]})"
    elif op.name == "ac.constant":
        expr = literal(op.attrs["value"], dtype)
    elif op.name == "ac.gather":
        src = k.operand(op.operands[0])
        picks = []
        for axis, idx in enumerate(op.operands[1:]):
            var = k.fresh("ix")
            k.w.line(f"{var} = {k.load(idx, index)}")
            k.w.line(f"if {var} < 0 or {var} >= {src}.shape[{axis}]:")
            with k.w.indent():
                record_bad_index(k.w, axis, var)
                k.w.line(f"{var} = 0")
            picks.append(var)
        expr = widen(dtype, f"{src}[{', '.join(picks)}]")
    else:
        names = {v: k.load(v, index) for v in dict.fromkeys(op.operands)}
        emitter = ScalarEmitter(k.w, names, k.fresh, k.operand, FUNCTIONS)
        emitter.op(op)
        expr = names[out]
    k.store(index, expr)
    at = "" if op.loc is None else str(op.loc).replace("{", "{{").replace("}", "}}")
    after = [f"rt.check_indices({{err}}, {{a0}}.shape, {at!r})"] if op.name == "ac.gather" else []
    return k.finish(after=after)


def _layout(name: str, op: Op) -> GraphKernel:
    """Copies: each output element reads one operand element (or, for cache_append, each new entry
    is written into the cache)."""
    if op.name == "ac.cache_append":
        return cache_append_kernel(name, [(op, False, False)])
    k = _Writer(name, op)
    attrs = op.attrs
    srcs = [k.operand(v) for v in op.operands]
    if op.name == "ac.slice":
        k.param("start", "int", "int64", expr=dim_expr(attrs["start"]))
    elif op.name == "ac.repeat_kv":
        k.param("n_rep", "int", "int64", expr=dim_expr(attrs["n_rep"]))
    elif op.name == "ac.concat":
        offset = dim(0)
        for n in range(1, len(op.operands)):
            offset = offset + op.operands[n - 1].type.shape[attrs["axis"]]
            k.param(f"off_{n}", "int", "int64", expr=dim_expr(offset))
    k.start()
    index = k.out_index()
    if op.name == "ac.transpose":
        at = [""] * op.operands[0].type.rank
        for axis, source_axis in enumerate(attrs["perm"]):
            at[source_axis] = index[axis]
        k.store(index, f"{srcs[0]}[{', '.join(at)}]")
    elif op.name == "ac.slice":
        at = list(index)
        at[attrs["axis"]] = f"start + {attrs['step']} * {index[attrs['axis']]}"
        k.store(index, f"{srcs[0]}[{', '.join(at)}]")
    elif op.name == "ac.repeat_kv":
        at = list(index)
        at[1] = f"{index[1]} // n_rep"
        k.store(index, f"{srcs[0]}[{', '.join(at)}]")
    elif op.name == "ac.concat":
        axis = attrs["axis"]
        for n, src in enumerate(srcs):
            at = list(index)
            if n:
                at[axis] = f"{index[axis]} - off_{n}"
            test = "if" if n == 0 else "elif"
            if n < len(srcs) - 1:
                k.w.line(f"{test} {index[axis]} < off_{n + 1}:")
            else:
                k.w.line("else:" if n else "if True:")
            with k.w.indent():
                k.store(index, f"{src}[{', '.join(at)}]")
    else:
        raise LoweringError(f"cuda: no layout kernel for {op.name}")
    return k.finish()


#: what a kernel storing bf16 patterns imports (``warp.round_bf16``)
ROUND_BF16 = "from attncomp.backends.numba_cuda.warp import round_bf16"


def cache_append_kernel(name: str, appends: list[tuple[Op, bool, bool]]) -> GraphKernel:
    """``ac.cache_append``s, in one launch: each new entry written into its cache in place (the driver
    takes a view of the cache as the result).  Per append, ``(op, cache_bits, new_bits)``: the cache
    holds bf16 as 16-bit patterns; new entries held so too (``new_bits``) are copied, float32 ones
    (computed) rounded to bf16 as they are written (to nearest even, NaN kept: ``warp.round_bf16``).
    The grid-stride loop runs over every append's new entries, the first append's first."""
    k = _Writer(name, appends[0][0])
    k.params.clear()
    rounding = False
    for n, (op, cache_bits, new_bits) in enumerate(appends):
        cache, new = op.operands
        cache_type = array_type(cache.type.dtype, cache.type.rank, contiguous_at_call(cache), patterns=cache_bits)
        k.param(f"cache_{n}", "array", cache_type, cache)
        new_type = array_type(new.type.dtype, new.type.rank, contiguous_at_call(new), patterns=new_bits)
        k.param(f"new_{n}", "array", new_type, new)
        k.param(f"length_{n}", "int", "int64", expr=dim_expr(op.attrs["length"]))
        rounding = rounding or (cache_bits and not new_bits)
    ends = [" + ".join(f"new_{m}.size" for m in range(n + 1)) for n in range(len(appends))]
    k.start(ends[-1])
    for n, (op, cache_bits, new_bits) in enumerate(appends):
        cache, new = op.operands
        k.w.line(f"{'if' if n == 0 else 'elif'} flat < {ends[n]}:")
        with k.w.indent():
            k.w.line(f"item = flat{f' - ({ends[n - 1]})' if n else ''}")
            index = k.decode([f"new_{n}.shape[{a}]" for a in range(new.type.rank)], flat="item")
            axis = op.attrs["axis"] % cache.type.rank
            at = list(index)
            at[axis] = f"length_{n} + {index[axis]}"
            element = f"new_{n}[{', '.join(index)}]"
            if cache_bits and not new_bits:
                element = f"round_bf16({element})"
            k.w.line(f"cache_{n}[{', '.join(at)}] = {element}")
    return k.finish(work="new_0", imports=[ROUND_BF16] if rounding else [])


def bf16_patterns_kernel(name: str, value: Value) -> GraphKernel:
    """A C-contiguous copy of ``value`` (float32, of any layout) rounded to bf16 patterns (uint16): what
    an attention kernel reading 16-bit patterns takes for a computed source (``warp.round_bf16``)."""
    k = _Writer(name, None, out=value)
    k.params[0].numba_type = array_type(value.type.dtype, value.type.rank, contiguous=True, patterns=True)
    a = k.operand(value)
    k.start()
    index = ", ".join(k.out_index())
    k.w.line(f"out[{index}] = round_bf16({a}[{index}])")
    return k.finish(imports=[ROUND_BF16])


def reshape_copy(name: str, op: Op) -> GraphKernel:
    """A contiguous copy of a strided operand, so a reshape can be a view of it."""
    k = _Writer(name, op)
    src = op.operands[0]
    k.params[0].numba_type = array_type(src.type.dtype, src.type.rank, contiguous=True)
    a = k.operand(src)
    k.params[-1].numba_type = array_type(src.type.dtype, src.type.rank)  # launched for strided operands only
    k.start()
    index = k.decode([f"{a}.shape[{d}]" for d in range(src.type.rank)])
    k.w.line(f"out[{', '.join(index)}] = {a}[{', '.join(index)}]")
    return k.finish()


def _reduce_loops(k: _Writer, src: str, axes: list[int], kept_index: dict[int, str], rank: int, body) -> None:
    """Nested loops over the reduced ``axes``; ``body(at)`` gets the operand index."""
    at = [kept_index.get(a, "") for a in range(rank)]
    depth = 0
    for a in axes:
        at[a] = f"u{a}"
        k.w.line(f"for u{a} in range({src}.shape[{a}]):")
        k.w.depth += 1
        depth += 1
    body(at)
    k.w.depth -= depth


def _rows(name: str, op: Op) -> GraphKernel:
    k = _Writer(name, op)
    src_value = op.operands[0]
    src = k.operand(src_value)
    rank = src_value.type.rank
    out_dtype = op.results[0].type.dtype
    attrs = op.attrs
    floating = is_float(src_value.type.dtype)
    acc = NUMPY_SCALAR[accumulation_dtype(src_value.type.dtype)] if floating else "np.int64"
    w = k.w
    if op.name == "ac.reduce":
        axes, keepdims, kind = attrs["axes"], attrs["keepdims"], attrs["kind"]
        k.start()
        index = k.out_index()
        kept = [a for a in range(rank) if a not in axes]
        if keepdims:
            kept_index = {a: index[a] for a in kept}
        else:
            kept_index = {a: index[n] for n, a in enumerate(kept)} if kept else {}
        if kind in ("sum", "mean"):
            w.line(f"total = {acc}(0)")
        else:
            low = "-np.inf" if floating else "-9223372036854775807 - 1"
            high = "np.inf" if floating else "9223372036854775807"
            w.line(f"total = {acc}({low if kind == 'max' else high})")

        def body(at):
            w.line(f"x = {acc}({src}[{', '.join(at)}])")
            if kind in ("sum", "mean"):
                w.line("total += x")
            else:  # a NaN wins, as in np.max
                cmp = ">" if kind == "max" else "<"
                w.line(f"if x {cmp} total or x != x:")
                with w.indent():
                    w.line("total = x")

        _reduce_loops(k, src, axes, kept_index, rank, body)
        if kind == "mean":
            count = " * ".join(f"{src}.shape[{a}]" for a in axes) or "1"
            k.store(index, f"{compute_type(out_dtype)}(total / {count})")
        else:
            k.store(index, f"{compute_type(out_dtype)}(total)")
        return k.finish()
    if op.name == "ac.block_reduce":
        axis, block, kind = attrs["axis"], attrs["block"], attrs["kind"]
        k.start()
        index = k.out_index()
        at = list(index)
        w.line(f"first = {index[axis]} * {block}")
        w.line(f"stop = min(first + {block}, {src}.shape[{axis}])")
        at[axis] = "first"
        w.line(f"total = {src}[{', '.join(at)}]")
        at[axis] = "u"
        w.line("for u in range(first + 1, stop):")
        with w.indent():
            w.line(f"total = {'min' if kind == 'min' else 'max'}(total, {src}[{', '.join(at)}])")
        k.store(index, "total")
        return k.finish()
    # softmax / logsumexp: one row (all axes but one) per iteration
    axis = attrs["axis"]
    others = [a for a in range(rank) if a != axis]
    count = " * ".join(f"{src}.shape[{a}]" for a in others) or "1"
    k.start("n_rows", setup=(f"n_rows = {count}",))
    names = k.decode([f"{src}.shape[{a}]" for a in others]) if others else []
    at = [""] * rank
    for a, n in zip(others, names):
        at[a] = n
    at[axis] = "u"
    x = f"{acc}({src}[{', '.join(at)}])"
    w.line(f"mx = {acc}(-np.inf)")
    w.line(f"for u in range({src}.shape[{axis}]):")
    with w.indent():
        w.line(f"x = {x}")
        w.line("if x > mx or x != x:")
        with w.indent():
            w.line("mx = x")
    w.line("if mx == -np.inf:  # a row of -inf: every term is exp(-inf) = 0")
    with w.indent():
        w.line(f"mx = {acc}(0.0)")
    w.line(f"total = {acc}(0.0)")
    w.line(f"for u in range({src}.shape[{axis}]):")
    with w.indent():
        w.line(f"total += math.exp({x} - mx)")
    if op.name == "ac.softmax":
        w.line("if total == 0.0:")
        with w.indent():
            w.line(f"total = {acc}(1.0)")
        w.line(f"for u in range({src}.shape[{axis}]):")
        with w.indent():
            w.line(f"out[{', '.join(at)}] = {compute_type(out_dtype)}(math.exp({x} - mx) / total)")
        return k.finish(work="a0", work_axis=axis)
    out_at = list(names)
    if attrs["keepdims"]:
        out_at = list(at)
        out_at[axis] = "0"
    if not out_at:
        out_at = ["0"]
    w.line(f"out[{', '.join(out_at)}] = {compute_type(out_dtype)}(mx + math.log(total) if total > 0 else -np.inf)")
    return k.finish(work="a0", work_axis=axis)


def _matmul(name: str, op: Op) -> GraphKernel:
    k = _Writer(name, op)
    a_value, b_value = op.operands
    a, b = k.operand(a_value), k.operand(b_value)
    out_type = op.results[0].type
    rank = out_type.rank
    dtype = out_type.dtype
    acc = NUMPY_SCALAR[accumulation_dtype(dtype)] if is_float(dtype) else "np.int64"
    tile = MATMUL_TILE
    w = k.w
    w.line("@cuda.jit(cache=True)")
    w.line(f"def {name}({', '.join(p.name for p in k.params)}):")
    with w.indent():
        w.line(f"sa = cuda.shared.array(({tile}, {tile}), {acc})")
        w.line(f"sb = cuda.shared.array(({tile}, {tile}), {acc})")
        w.line("tx = cuda.threadIdx.x")
        w.line("ty = cuda.threadIdx.y")
        w.line(f"row = cuda.blockIdx.y * {tile} + ty")
        w.line(f"col = cuda.blockIdx.x * {tile} + tx")
        w.line(f"n_m = out.shape[{rank - 2}]")
        w.line(f"n_n = out.shape[{rank - 1}]")
        w.line(f"n_k = {a}.shape[{a_value.type.rank - 1}]")
        w.line("n_batch = " + (" * ".join(f"out.shape[{d}]" for d in range(rank - 2)) or "1"))
        w.line("for bz in range(cuda.blockIdx.z, n_batch, cuda.gridDim.z):")
        with w.indent():
            batch = k.decode([f"out.shape[{d}]" for d in range(rank - 2)], prefix="o", flat="bz")
            index = batch + ["row", "col"]
            a_batch = k.broadcast(a_value, index, out_type)[:-2]
            b_batch = k.broadcast(b_value, index, out_type)[:-2]
            w.line(f"total = {acc}(0)")
            w.line(f"for k0 in range(0, n_k, {tile}):")
            with w.indent():
                a_at = ", ".join(a_batch + ["row", "k0 + tx"])
                b_at = ", ".join(b_batch + ["k0 + ty", "col"])
                w.line(f"sa[ty, tx] = {acc}({a}[{a_at}]) if row < n_m and k0 + tx < n_k else {acc}(0)")
                w.line(f"sb[ty, tx] = {acc}({b}[{b_at}]) if k0 + ty < n_k and col < n_n else {acc}(0)")
                w.line("cuda.syncthreads()")
                w.line(f"for kk in range({tile}):")
                with w.indent():
                    w.line("total += sa[ty, kk] * sb[kk, tx]")
                w.line("cuda.syncthreads()")
            w.line("if row < n_m and col < n_n:")
            with w.indent():
                w.line(f"out[{', '.join(index)}] = total")
    return k.finish("matmul")


def _broadcast_extents(values: list[Value]) -> list[tuple[Value, int] | None]:
    """Per axis of the broadcast shape of ``values``: an operand and axis giving its extent (None: 1)."""
    rank = max(v.type.rank for v in values)
    found: list[tuple[Value, int] | None] = []
    for k in range(rank):
        pick = None
        for value in values:
            m = k - (rank - value.type.rank)
            if m >= 0 and not (value.type.shape[m].is_const and value.type.shape[m].value == 1):
                pick = (value, m)
                break
        found.append(pick)
    return found


def scatter_add_kernel(name: str, op: Op, acc: str) -> tuple[GraphKernel, str]:
    """``ac.scatter_add``: the kernel and the driver's expression for its work (the broadcast elements).

    One broadcast element per iteration of a grid-stride loop, added into ``out`` (zeroed by the driver,
    in the accumulation type ``acc``) with ``cuda.atomic.add``; a thread keeps a running sum while its
    elements go to one target element (the gradient of ``slopes[h]`` sends T x S of them to each) and
    issues one atomic per run.  An index out of range sets ``err`` and is dropped; the driver then raises
    the interpreter's ``IndexError``.
    """
    from attncomp.backends.codegen import dim_expr

    k = _Writer(name, op)
    out = op.results[0]
    k.params[0].numba_type = array_type(acc, max(out.type.rank, 1), contiguous=True)
    updates, *indices = op.operands
    refs = [k.operand(v) for v in op.operands]
    k.param("err", "err", "int64[::1]")
    extents = _broadcast_extents(list(op.operands))
    count = " * ".join(dim_expr(v.type.shape[m]) for v, m in (e for e in extents if e is not None)) or "1"
    runtime = [f"{refs[op.operands.index(e[0])]}.shape[{e[1]}]" if e else "1" for e in extents]
    rank = out.type.rank
    current = "cur_0" if rank == 1 else f"({', '.join(f'cur_{a}' for a in range(rank))})"  # a plain index in 1-d
    acc_type = NUMPY_SCALAR[acc]
    w = k.w
    k.start(
        " * ".join(runtime) or "1", setup=(f"run = {acc_type}(0.0)", *(f"cur_{a} = np.int64(-1)" for a in range(rank)))
    )
    shape = TensorType(tuple(dim(1) if e is None else e[0].type.shape[e[1]] for e in extents), out.type.dtype)
    index = k.decode(runtime) if extents else []
    k.out_type = shape
    value = k.load(updates, index)
    picks = []
    for idx in indices:
        var = k.fresh("ix")
        w.line(f"{var} = np.int64({k.load(idx, index)})")
        picks.append(var)
    if rank == 0:
        w.line(f"run += {acc_type}({value})")
    else:
        bad = [f"{x} < 0 or {x} >= out.shape[{a}]" for a, x in enumerate(picks)]
        w.line(f"if {' or '.join(f'({b})' for b in bad)}:")
        with w.indent():
            for a, x in enumerate(picks):
                w.line(f"if {bad[a]}:")
                with w.indent():
                    record_bad_index(w, a, x)
        w.line(f"elif {' and '.join(f'{x} == cur_{a}' for a, x in enumerate(picks))}:")
        with w.indent():
            w.line(f"run += {acc_type}({value})")
        w.line("else:")
        with w.indent():
            w.line("if cur_0 >= 0:")
            with w.indent():
                w.line(f"cuda.atomic.add(out, {current}, run)")
            for a, x in enumerate(picks):
                w.line(f"cur_{a} = {x}")
            w.line(f"run = {acc_type}({value})")
    w.depth -= 1  # after the loop: this thread's last run
    if rank == 0:
        w.line("cuda.atomic.add(out, 0, run)")
    else:
        w.line("if cur_0 >= 0:")
        with w.indent():
            w.line(f"cuda.atomic.add(out, {current}, run)")
    return k.finish(), count


def graph_kernel(name: str, op: Op) -> GraphKernel:
    """The kernel computing ``op``'s result on the device."""
    if op.name in ELEMENTWISE:
        return _elementwise(name, op)
    if op.name in LAYOUT:
        return _layout(name, op)
    if op.name in ROWS:
        return _rows(name, op)
    if op.name == "ac.matmul":
        return _matmul(name, op)
    raise LoweringError(f"the cuda backend cannot lower {op.name} outside a tile grid")
