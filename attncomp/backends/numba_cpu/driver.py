"""The generated driver: graph-level ops as numpy calls, tiled attention as kernel calls.

Ops outside a tile grid (projections, norms, rotary embeddings, gathers, and
every op of an unfused graph) are materialised with numpy, which calls BLAS
for matmuls; each ``ac.tile_grid`` becomes a call of its Numba kernel.
"""

from __future__ import annotations

from attncomp.backends.codegen import NUMPY_SCALAR, SourceWriter, dim_expr, dim_var, page_size, size_names
from attncomp.backends.host_ops import (
    NUMPY_BINARY,
    NUMPY_COMPARE,
    NUMPY_UNARY,
    check_index_call,
    py_literal,
    shape_expr,
)
from attncomp.backends.numba_cpu.signatures import argument_dtype
from attncomp.backends.tiles import LoweringError
from attncomp.ir.core import Func, Op, Value, captured_values
from attncomp.ir.dims import dim
from attncomp.ir.types import accumulation_dtype


def _slice(a: list[str], attrs: dict, out: Value) -> str:
    index = ["slice(None)"] * out.type.rank
    start, stop = dim_expr(dim(attrs["start"])), dim_expr(dim(attrs["stop"]))
    index[attrs["axis"]] = f"slice({start}, {stop}, {attrs['step']})"
    return f"{a[0]}[{', '.join(index)},]"


def _call(fn: str):
    """The lowering ``fn(operands...)``."""
    return lambda a, attrs, out: f"{fn}({', '.join(a)})"


#: graph op -> the numpy expression of its result, from operand names, attributes and the result
GRAPH_OPS = {
    **{name: _call(fn) for name, fn in {**NUMPY_UNARY, **NUMPY_BINARY}.items()},
    "ac.constant": lambda a, attrs, out: f"np.full({shape_expr(out)}, {py_literal(attrs['value'])})",
    "ac.dim": lambda a, attrs, out: dim_expr(attrs["value"]),
    "ac.iota": lambda a, attrs, out: f"rt.iota({shape_expr(out)}, {attrs['axis']})",
    "ac.rsqrt": lambda a, attrs, out: f"1.0 / np.sqrt({a[0]})",
    "ac.cmp": lambda a, attrs, out: f"{NUMPY_COMPARE[attrs['pred']]}({a[0]}, {a[1]})",
    "ac.where": lambda a, attrs, out: f"np.where({a[0]}, {a[1]}, {a[2]})",
    "ac.random": lambda a, attrs, out: f"rt.uniform({', '.join(a)})",
    "ac.cast": lambda a, attrs, out: a[0],
    "ac.matmul": lambda a, attrs, out: f"np.matmul({a[0]}, {a[1]})",
    "ac.transpose": lambda a, attrs, out: f"np.transpose({a[0]}, {tuple(attrs['perm'])})",
    "ac.reshape": lambda a, attrs, out: f"{a[0]}.reshape({shape_expr(out)})",
    "ac.slice": _slice,
    "ac.concat": lambda a, attrs, out: f"np.concatenate([{', '.join(a)}], axis={attrs['axis']})",
    "ac.repeat_kv": lambda a, attrs, out: f"np.repeat({a[0]}, {dim_expr(dim(attrs['n_rep']))}, axis=1)",
    "ac.gather": lambda a, attrs, out: f"rt.gather({', '.join(a)})",
    "ac.scatter_add": lambda a, attrs, out: f"rt.scatter_add({shape_expr(out)}, {', '.join(a)})",
    "ac.reduce": lambda a, attrs, out: f"rt.reduce({attrs['kind']!r}, {a[0]}, {attrs['axes']}, {attrs['keepdims']})",
    "ac.softmax": lambda a, attrs, out: f"rt.softmax({a[0]}, {attrs['axis']})",
    "ac.logsumexp": lambda a, attrs, out: f"rt.logsumexp({a[0]}, {attrs['axis']}, {attrs['keepdims']})",
    "ac.cache_append": lambda a, attrs, out: (
        f"rt.cache_append({a[0]}, {a[1]}, {attrs['axis']}, {dim_expr(dim(attrs['length']))})"
    ),
    "ac.block_reduce": lambda a, attrs, out: (
        f"rt.block_reduce({a[0]}, {attrs['axis']}, {attrs['block']}, {attrs['kind']!r})"
    ),
}


#: 0-d ops the driver computes once per sizes when sizes and constants are all they read
SIZED_OPS = {"ac.dim", "ac.constant", "ac.cast", "ac.cmp", "ac.where", *NUMPY_UNARY, *NUMPY_BINARY}
#: the size tuples whose values a driver keeps
SIZED_KEPT = 64
#: ops whose numpy arithmetic may warn (the driver silences that: the IR's results are inf or nan)
NUMPY_OPS = {*NUMPY_UNARY, *NUMPY_BINARY, "ac.cmp", "ac.where", "ac.rsqrt", "ac.matmul", "ac.reduce"}
NUMPY_OPS |= {"ac.softmax", "ac.logsumexp", "ac.block_reduce", "ac.scatter_add", "ac.gather", "ac.constant"}


class DriverWriter:
    def __init__(self, func: Func, kernels: dict[Op, tuple[str, dict[Value, str]]], in_place: set[Value] | None = None):
        self.func = func
        #: transposes the kernels read in place (``signatures.transposes_in_place``): not computed
        self.in_place = in_place or set()
        #: such a transpose -> the array before it, which kernels read (numpy reads a view of it)
        self.kernel_arrays: dict[Value, str] = {}
        self.kernels = kernels
        self.w = SourceWriter()
        self.names: dict[Value, str] = {}
        self.counter = 0
        #: cache views -> the whole cache: kernels read the buffer in place, bounded by the IR's sizes
        self.buffers: dict[Value, Value] = {}
        #: ``sum(a * b, last axis, keepdims)`` whose product nothing else reads (the backward's
        #: ``delta = sum(dO * O)``): the reduce -> its product, computed in one ``np.einsum``
        self.row_dots: dict[Op, Op] = {}
        readers: dict[Value, int] = {}
        #: the ops reading each value, captured ones included (a tile grid's regions read its tiles' sources)
        self.readers: dict[Value, list[Op]] = {}
        for op in func.body.ops:
            for v in op.operands:
                readers[v] = readers.get(v, 0) + 1
            for v in [*op.operands, *(captured_values(op) if op.regions else [])]:
                self.readers.setdefault(v, []).append(op)
        for op in func.body.ops:
            product = op.operands[0].owner if op.name == "ac.reduce" else None
            if getattr(product, "name", None) != "ac.mul" or readers[op.operands[0]] != 1:
                continue
            a, b = product.operands
            rank = a.type.rank
            if (
                op.attrs["kind"] == "sum"
                and op.attrs["keepdims"]
                and [x % max(rank, 1) for x in op.attrs["axes"]] == [rank - 1]
                and rank >= 1
                and a.type.shape == b.type.shape
                and a.type.dtype == b.type.dtype in ("f32", "f64")
            ):
                self.row_dots[op] = product
        self.fused = set(self.row_dots.values())

    def fresh(self, value: Value) -> str:
        self.counter += 1
        hint = "".join(ch if ch.isalnum() else "_" for ch in (value.name or "v"))
        name = f"{hint}_{self.counter}"
        self.names[value] = name
        return name

    def ref(self, value: Value) -> str:
        return self.names[value]

    def assign(self, value: Value, expr: str) -> None:
        self.w.line(f"{self.fresh(value)} = rt.cast({expr}, {value.type.dtype!r})")

    def op(self, op: Op) -> None:
        if op in self.fused:  # computed with the reduce that reads it
            return
        if op in self.row_dots:
            x, y = (self.ref(v) for v in self.row_dots[op].operands)
            self.assign(op.results[0], f"np.einsum('...e,...e->...', {x}, {y})[..., None]")
            return
        name, a = op.name, [self.ref(v) for v in op.operands]
        if name == "ac.return":
            self.w.line(f"return ({''.join(x + ', ' for x in a)})")
        elif name == "ac.tile_grid":
            self.grid(op)
        elif name == "ac.key_grid":
            self.key_grid(op)
        elif name == "ac.check_index":
            self.w.line(check_index_call(op, a))
        elif name == "ac.transpose" and op.results[0] in self.in_place:  # kernels read the array as it is
            self.kernel_arrays[op.results[0]] = a[0]
            if all(user.name in ("ac.tile_grid", "ac.key_grid") for user in self.readers[op.results[0]]):
                self.names[op.results[0]] = a[0]
            else:  # the driver's numpy reads a view of it: nothing copied
                self.w.line(f"{self.fresh(op.results[0])} = np.transpose({a[0]}, {tuple(op.attrs['perm'])})")
        elif name == "ac.page_view":  # kernels read the pages through the table; nothing is copied
            rows = dim_expr(dim(op.attrs["rows"]))
            size = page_size(a[0], op)
            self.w.line(f"rt.check_pages({a[1]}, {a[0]}.shape[0], {size}, {rows})")
            self.names[op.results[0]] = a[0]
            self.buffers[op.results[0]] = op.operands[0]
        elif name == "ac.cache_append" and len(op.operands) == 3:  # an 8-bit cache, read in place by kernels
            if any(user.name != "ac.tile_grid" for user in self.readers.get(op.results[0], [])):
                raise LoweringError("the cpu backend reads an 8-bit cache in an attention's tiles only")
            length = dim_expr(dim(op.attrs["length"]))
            self.w.line(f"rt.cache_append_quantized({', '.join(a)}, {op.attrs['axis']}, {length})")
            self.names[op.results[0]] = a[0]
            self.buffers[op.results[0]] = op.operands[0]
        elif name == "ac.gather" and op.loc is not None:
            self.assign(op.results[0], f"rt.gather({', '.join(a)}, at={str(op.loc)!r})")
        elif name in GRAPH_OPS:
            self.assign(op.results[0], GRAPH_OPS[name](a, op.attrs, op.results[0]))
            if name == "ac.cache_append":
                self.buffers[op.results[0]] = op.operands[0]
        else:
            raise LoweringError(f"the cpu backend cannot lower {name} outside a tile grid")

    def grid(self, op: Op) -> None:
        kernel, captured = self.kernels[op]
        outs = []
        for result in op.results:
            name = self.fresh(result)
            # kernels write float32 (or float64) rows; narrower results are cast after
            dtype = NUMPY_SCALAR[accumulation_dtype(result.type.dtype)]
            self.w.line(f"{name} = np.empty({shape_expr(result)}, dtype={dtype})")
            outs.append(name)
        acc = accumulation_dtype(op.results[0].type.dtype)
        args = self.kernel_args(op, captured, acc)
        dims = [dim_var(d) for d in self.dim_names()]
        tasks = [f"*{kernel.upper()}_TASKS"]  # the task functions, called through pointers
        self.w.line(f"{kernel}({', '.join(tasks + outs + args + dims + ['rt.num_threads()'])})")
        for result in op.results:
            self.w.line(f"{self.names[result]} = rt.cast({self.names[result]}, {result.type.dtype!r})")

    def kernel_args(self, op: Op, captured: dict[Value, str], acc: str) -> list[str]:
        """The kernel's arguments for the values its regions capture (tile sources in ``acc``)."""
        args = []
        for value in captured:
            value_ref = self.kernel_arrays.get(value) or self.ref(self.buffers.get(value, value))
            if value.type.rank == 0:
                args.append(f"rt.kernel_scalar({self.ref(value)}, {value.type.dtype!r})")
            else:  # the dtype the kernel's signature names (signatures.captured_types)
                args.append(f"rt.kernel_array({value_ref}, {argument_dtype(value, op, acc)!r})")
        return args

    def key_grid(self, op: Op) -> None:
        """The backward kernel: gradients accumulate in zeroed arrays; site parts summed after."""
        kernel, captured = self.kernels[op]
        acc = accumulation_dtype(op.results[0].type.dtype)
        dtype = NUMPY_SCALAR[acc]
        outs = []
        for result in op.results[:3]:
            outs.append(self.fresh(result))
            self.w.line(f"{outs[-1]} = np.zeros({shape_expr(result)}, dtype={dtype})")
        dk = op.results[1]
        units = " * ".join(dim_expr(d) for d in dk.type.shape[:-2]) or "1"
        slots = f"slots_{self.counter}"
        self.w.line(f"{slots} = max(1, min({units}, rt.num_threads()))")
        parts = []
        for result in op.results[3:]:
            parts.append(self.fresh(result))
            self.w.line(f"{parts[-1]} = np.zeros(({slots}, *{shape_expr(result)}), dtype={dtype})")
        dims = [dim_var(d) for d in self.dim_names()]
        args = outs + parts + self.kernel_args(op, captured, acc) + dims + [slots]
        self.w.line(f"{kernel}(*{kernel.upper()}_TASKS, {', '.join(args)})")
        for result in op.results[3:]:
            self.w.line(f"{self.names[result]} = {self.names[result]}.sum(axis=0)")
        for result in op.results:
            self.w.line(f"{self.names[result]} = rt.cast({self.names[result]}, {result.type.dtype!r})")

    def dim_names(self) -> list[str]:
        return size_names(self.func)

    def sized_ops(self) -> tuple[list[Op], list[str]]:
        """The leading 0-d ops computed from sizes and constants alone (a scale ``D ** -0.5``), and
        the sizes they read: the same for every call with those sizes, so computed once per sizes."""
        found: list[Op] = []
        known: set[Value] = set()
        symbols: set[str] = set()
        for op in self.func.body.ops:
            scalar = len(op.results) == 1 and op.results[0].type.rank == 0 and not op.regions
            if not (scalar and op.name in SIZED_OPS and all(v in known for v in op.operands)):
                continue
            found.append(op)
            known.add(op.results[0])
            if op.name == "ac.dim":
                symbols |= dim(op.attrs["value"]).symbols()
        return found, sorted(symbols)

    def write(self) -> str:
        w = self.w
        params = [self.fresh(a) for a in self.func.args]
        sized, symbols = self.sized_ops()
        if sized:
            # numpy's own arithmetic on 0-d values (its rounding, overflow to inf), memoised by the sizes
            w.line(f"def sized_values({', '.join(dim_var(d) for d in symbols)}):")
            with w.indent():
                w.line("with np.errstate(all='ignore'):")
                with w.indent():
                    for op in sized:
                        self.op(op)
                    w.line(f"return ({''.join(self.ref(op.results[0]) + ', ' for op in sized)})")
            w.line()
            w.line()
            w.line("SIZED_VALUES = {}")
            w.line()
            w.line()
        w.line(f"def run({', '.join(params + ['env'])}):")
        with w.indent():
            for d in self.dim_names():
                w.line(f"{dim_var(d)} = env[{d!r}]")
            rest = [op for op in self.func.body.ops if op not in sized]
            if sized:
                key = "(" + "".join(f"{dim_var(d)}, " for d in symbols) + ")"
                w.line(f"sized = SIZED_VALUES.get({key})")
                w.line("if sized is None:")
                with w.indent():
                    w.line(f"if len(SIZED_VALUES) > {SIZED_KEPT}:")
                    with w.indent():
                        w.line("SIZED_VALUES.clear()")
                    w.line(f"sized = SIZED_VALUES[{key}] = sized_values({', '.join(dim_var(d) for d in symbols)})")
                w.line(f"{''.join(self.ref(op.results[0]) + ', ' for op in sized)}= sized")
            narrowing = any(r.type.dtype in ("f16", "bf16") for op in rest for r in op.results)
            # einsum (the fused row dots) raises no floating-point warnings
            warns = [op for op in rest if op.name in NUMPY_OPS and op not in self.row_dots and op not in self.fused]
            if narrowing or warns:
                w.line("with np.errstate(all='ignore'):")
                with w.indent():
                    for op in rest:
                        self.op(op)
            else:  # only kernels and copies: nothing numpy could warn about
                for op in rest:
                    self.op(op)
        return w.text()
