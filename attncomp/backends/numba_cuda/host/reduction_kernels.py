"""The graph kernels that reduce: **row** kernels (``reduce``, ``softmax``, ``logsumexp``,
``block_reduce``: one output element or row per iteration, the reduced axes looped over), the
**matmul** (16 x 16 tiles of both operands staged in shared memory), and ``scatter_add`` (a
running sum per target element, added in with atomics)."""

from __future__ import annotations

from attncomp.backends.codegen import NUMPY_SCALAR, ScalarEmitter, dim_expr
from attncomp.backends.numba_cuda.device_math import FUNCTIONS
from attncomp.backends.numba_cuda.host.fused_reductions import FusedReduction, source_index, unit_reshape
from attncomp.backends.numba_cuda.host.graph_kernel_writer import (
    WIDEN_IMPORT,
    GraphKernel,
    GraphKernelWriter,
    array_type,
    compute_type,
    record_bad_index,
)
from attncomp.backends.numba_cuda.host.launches import MATMUL_TILE
from attncomp.ir.core import Op, Value
from attncomp.ir.dims import dim
from attncomp.ir.types import BOOL_DTYPE, TensorType, accumulation_dtype, is_float

ROWS = {"ac.reduce", "ac.softmax", "ac.logsumexp", "ac.block_reduce"}


def _accumulation(value: Value) -> str:
    return NUMPY_SCALAR[accumulation_dtype(value.type.dtype)] if is_float(value.type.dtype) else "np.int64"


class _Inline:
    """Scalar code for values the fused ``ops`` compute, at an element of the value's own shape: an
    elementwise op's operands at that element broadcast, a unit reshape's operand at the same element
    with the size-1 axes' indices dropped or added, any other value loaded (each once per element)."""

    def __init__(self, k: GraphKernelWriter, ops: list[Op], known: dict | None = None):
        self.k = k
        self.ops = set(ops)
        self.known: dict[tuple[Value, tuple[str, ...]], str] = dict(known or {})

    def value(self, value: Value, index: list[str]) -> str:
        key = (value, tuple(index))
        if key not in self.known:
            self.known[key] = self._compute(value, index)
        return self.known[key]

    def _compute(self, value: Value, index: list[str]) -> str:
        op = value.owner if isinstance(value.owner, Op) else None
        if op not in self.ops:
            return self.k.load(value, index, into=value.type)
        if unit_reshape(op):
            return self.value(op.operands[0], source_index(op, index))
        names = {v: self.value(v, self.k.broadcast(v, index, value.type)) for v in op.operands}
        ScalarEmitter(self.k.w, names, self.k.fresh, self.k.operand, FUNCTIONS).op(op)
        return names[value]


def reduce_kernel(
    name: str, fused: FusedReduction, patterns: frozenset[Value] = frozenset(), views: frozenset[Value] = frozenset()
) -> GraphKernel:
    """``ac.reduce``: one output element per iteration, the reduced axes looped over.  Its producers
    are computed per element inside the loop from the arrays they read (as stored: a float16 element
    widened as it is loaded, a bf16 one held as its 16-bit ``patterns`` too; ``views``: transposed
    views of arguments, indexed where they lie), its epilogue per output element after it; neither
    has a buffer."""
    op = fused.reduce
    k = GraphKernelWriter(name, op, out=fused.out, patterns=patterns, views=views)
    src_value = op.operands[0]
    src_type = src_value.type
    rank = src_type.rank
    axes, keepdims, kind = op.attrs["axes"], op.attrs["keepdims"], op.attrs["kind"]
    for leaf in fused.leaves():
        k.operand(leaf)
    extents = {a: k.param(f"n{a}", "int", "int64", expr=dim_expr(src_type.shape[a])) for a in axes}
    for leaf in fused.epilogue_leaves():
        k.operand(leaf)
    floating = is_float(src_type.dtype)
    acc = _accumulation(src_value)
    w = k.w
    k.start()
    index = k.out_index()
    kept = [a for a in range(rank) if a not in axes]
    kept_index = {a: index[a] for a in kept} if keepdims else {a: index[n] for n, a in enumerate(kept)}
    if kind in ("sum", "mean"):
        w.line(f"total = {acc}(0)")
    else:
        low = "-np.inf" if floating else "-9223372036854775807 - 1"
        high = "np.inf" if floating else "9223372036854775807"
        w.line(f"total = {acc}({low if kind == 'max' else high})")
    at = [kept_index.get(a, f"u{a}") for a in range(rank)]
    for a in axes:
        w.line(f"for u{a} in range({extents[a]}):")
        w.depth += 1
    inline = _Inline(k, fused.producers)
    element = inline.value(src_value, at)
    w.line(f"x = {acc}({element})")
    if kind in ("sum", "mean"):
        w.line("total += x")
    else:  # a NaN wins, as in np.max
        w.line(f"if x {'>' if kind == 'max' else '<'} total or x != x:")
        with w.indent():
            w.line("total = x")
    w.depth -= len(axes)
    count = " * ".join(extents[a] for a in axes) or "1"
    result = compute_type(op.results[0].type.dtype)
    w.line(f"reduced = {result}(total / {count})" if kind == "mean" else f"reduced = {result}(total)")
    inline = _Inline(k, fused.epilogue_producers + fused.epilogue, {(op.results[0], tuple(index)): "reduced"})
    k.store(index, inline.value(fused.out, index))
    return k.finish(imports=[WIDEN_IMPORT] if k.read_patterns else [])


def row_kernel(name: str, op: Op, fused: FusedReduction | None = None) -> GraphKernel:
    """The kernel of a row op; an ``ac.reduce`` with its ``fused`` producers and epilogue inline."""
    if op.name == "ac.reduce":
        return reduce_kernel(name, fused or FusedReduction(op))
    k = GraphKernelWriter(name, op)
    src_value = op.operands[0]
    src = k.operand(src_value)
    rank = src_value.type.rank
    out_dtype = op.results[0].type.dtype
    attrs = op.attrs
    acc = _accumulation(src_value)
    w = k.w
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
            element = f"{src}[{', '.join(at)}]"
            if src_value.type.dtype == BOOL_DTYPE:  # a boolean's minimum is "and", its maximum "or"
                w.line(f"total = total {'&' if kind == 'min' else '|'} {element}")
            else:
                w.line(f"total = {'min' if kind == 'min' else 'max'}(total, {element})")
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


def matmul_kernel(name: str, op: Op) -> GraphKernel:
    k = GraphKernelWriter(name, op)
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

    k = GraphKernelWriter(name, op)
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
