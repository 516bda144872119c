"""Appending to a decoder's 8-bit cache on the device: new rows quantised as they are written.

An ``ac.cache_append`` with scales (``kv-cache-reuse{cache=f8e4m3}``) writes each new row of ``d``
entries (one token of one head) as 8-bit codes (uint8) and a float32 scale, with the arithmetic of
``ir.quantized.quantize``: ``scale = amax / MAX`` (NaN where the row holds a NaN), the entries divided
by the scale (by 1 where the scale is not positive: a row of zeros), saturated to ``[-MAX, MAX]``
(NaN kept) and rounded to nearest even (``fp8_codes.encode_*``).  One thread per row: a pass for the
row's largest magnitude, a pass writing its codes.  The appends of one step (keys and values) run in
one launch, the first append's rows first.
"""

from __future__ import annotations

from attncomp.backends.codegen import dim_expr
from attncomp.backends.numba_cuda.fp8_codes import ENCODE
from attncomp.backends.numba_cuda.fp8_codes import IMPORT as FP8_IMPORT
from attncomp.backends.numba_cuda.host.graph_kernel_writer import (
    GraphKernel,
    GraphKernelWriter,
    array_type,
    contiguous_at_call,
)
from attncomp.ir.core import Op
from attncomp.ir.quantized import CACHE_MAX


def codes_type(rank: int, contiguous: bool) -> str:
    """The Numba type of an 8-bit cache's codes (bytes)."""
    axes = [":"] * rank
    if contiguous:
        axes[-1] = "::1"
    return f"uint8[{', '.join(axes)}]"


def quantized_append_kernel(name: str, appends: list[Op]) -> GraphKernel:
    """``ac.cache_append``s to 8-bit caches (cache, scales, new entries), in one launch."""
    k = GraphKernelWriter(name, appends[0])
    k.params.clear()
    for n, op in enumerate(appends):
        cache, scales, new = op.operands
        k.param(f"cache_{n}", "array", codes_type(cache.type.rank, contiguous=True), cache)
        k.param(f"scale_{n}", "array", array_type("f32", scales.type.rank, contiguous=True), scales)
        k.param(f"new_{n}", "array", array_type(new.type.dtype, new.type.rank, contiguous_at_call(new)), new)
        k.param(f"length_{n}", "int", "int64", expr=dim_expr(op.attrs["length"]))
    rows = []
    for n, op in enumerate(appends):
        rank = op.operands[2].type.rank
        rows.append(" * ".join(f"new_{n}.shape[{a}]" for a in range(rank - 1)) or "1")
    ends = [" + ".join(f"({r})" for r in rows[: n + 1]) for n in range(len(appends))]
    k.start(ends[-1])
    w = k.w
    for n, op in enumerate(appends):
        cache, _, new = op.operands
        rank = new.type.rank
        top = f"np.float32({CACHE_MAX[cache.type.dtype]!r})"
        w.line(f"{'if' if n == 0 else 'elif'} flat < {ends[n]}:")
        with w.indent():
            w.line(f"item = flat{f' - ({ends[n - 1]})' if n else ''}")
            index = k.decode([f"new_{n}.shape[{a}]" for a in range(rank - 1)], flat="item")
            axis = op.attrs["axis"] % rank
            at = list(index)
            at[axis] = f"length_{n} + {index[axis]}"
            row, stored = ", ".join(index), ", ".join(at)
            w.line("amax = np.float32(0.0)")
            w.line("nan = False")
            w.line(f"for e in range(new_{n}.shape[{rank - 1}]):")
            with w.indent():
                w.line(f"a = abs(np.float32(new_{n}[{row}, e]))")
                w.line("if a != a:")
                with w.indent():
                    w.line("nan = True")
                w.line("elif a > amax:")
                with w.indent():
                    w.line("amax = a")
            w.line(f"scale = np.float32(np.nan) if nan else np.float32(amax / {top})")
            w.line("divisor = scale if scale > np.float32(0.0) else np.float32(1.0)")
            w.line(f"for e in range(new_{n}.shape[{rank - 1}]):")
            with w.indent():
                w.line(f"x = np.float32(np.float32(new_{n}[{row}, e]) / divisor)")
                w.line("if x == x:  # saturating: rounding never leaves the range")
                with w.indent():
                    w.line(f"x = min(max(x, -{top}), {top})")
                w.line(f"cache_{n}[{stored}, e] = {ENCODE[cache.type.dtype]}(x)")
            w.line(f"scale_{n}[{stored}] = scale")
    return k.finish(work="new_0", imports=[FP8_IMPORT])
