"""The **map** graph kernels: one output element per iteration of a grid-stride loop.

Elementwise ops, ``where``, ``cast``, ``iota``, tensor constants and ``gather`` compute the element
(its scalar code is the same :class:`ScalarEmitter` output the attention kernels use); the layout
ops ``transpose``, ``slice``, ``repeat_kv``, ``concat`` and ``cache_append``, and a reshape copy,
copy it.  Also the driver's ``bf16_patterns`` copies (16-bit patterns rounded from float32)."""

from __future__ import annotations

from attncomp.backends.codegen import ScalarEmitter, dim_expr, literal
from attncomp.backends.numba_cuda.device_math import FUNCTIONS
from attncomp.backends.numba_cuda.host.graph_kernel_writer import (
    GraphKernel,
    GraphKernelWriter,
    array_type,
    contiguous_at_call,
    record_bad_index,
    widen,
)
from attncomp.backends.tiles import LoweringError
from attncomp.ir.core import Op, Value
from attncomp.ir.dims import dim

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


def elementwise_kernel(name: str, op: Op) -> GraphKernel:
    k = GraphKernelWriter(name, op)
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


def layout_kernel(name: str, op: Op, rounded: bool = False) -> GraphKernel:
    """Copies: each output element reads one operand element (or, for cache_append, each new entry
    is written into the cache); ``rounded``: a transpose written as bf16 patterns (uint16, rounded to
    nearest even: a float32 value the function returns as bf16, rounded as it is copied)."""
    if op.name == "ac.cache_append":
        return cache_append_kernel(name, [(op, False, False)])
    k = GraphKernelWriter(name, op)
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
        if rounded:
            out = op.results[0].type
            k.params[0].numba_type = array_type(out.dtype, out.rank, contiguous=True, patterns=True)
            k.store(index, f"round_bf16({srcs[0]}[{', '.join(at)}])")
            return k.finish(imports=[ROUND_BF16])
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
    k = GraphKernelWriter(name, appends[0][0])
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
    k = GraphKernelWriter(name, None, out=value)
    k.params[0].numba_type = array_type(value.type.dtype, value.type.rank, contiguous=True, patterns=True)
    a = k.operand(value)
    k.start()
    index = ", ".join(k.out_index())
    k.w.line(f"out[{index}] = round_bf16({a}[{index}])")
    return k.finish(imports=[ROUND_BF16])


def reshape_copy(name: str, op: Op) -> GraphKernel:
    """A contiguous copy of a strided operand, so a reshape can be a view of it."""
    k = GraphKernelWriter(name, op)
    src = op.operands[0]
    k.params[0].numba_type = array_type(src.type.dtype, src.type.rank, contiguous=True)
    a = k.operand(src)
    k.params[-1].numba_type = array_type(src.type.dtype, src.type.rank)  # launched for strided operands only
    k.start()
    index = k.decode([f"{a}.shape[{d}]" for d in range(src.type.rank)])
    k.w.line(f"out[{', '.join(index)}] = {a}[{', '.join(index)}]")
    return k.finish()
