"""Source-text generation shared by the backends.

:class:`ScalarEmitter` turns 0-d ops (region bodies, tile prologues, the
tile classification) into statements of straight-line Python that Numba
(CPU) and Numba-CUDA both compile: one local variable per value, math from
``math``, element types made explicit with ``np.float32(...)`` and friends.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from typing import Any

from attncomp.ir.core import Block, Op, Value
from attncomp.ir.dims import Dim, dim
from attncomp.ir.ops.shape import page_slot
from attncomp.ir.types import is_float

NUMPY_SCALAR = {
    "f16": "np.float32",
    "bf16": "np.float32",
    "f32": "np.float32",
    "f64": "np.float64",
    "i32": "np.int64",
    "i64": "np.int64",
    "i1": "np.bool_",
}


class SourceWriter:
    """Lines of Python with indentation."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.depth = 0

    def line(self, text: str = "") -> None:
        self.lines.append(("    " * self.depth + text) if text else "")

    def line_each(self, texts: Iterable[str]) -> None:
        """Each of ``texts`` as a line, at the current indentation."""
        for text in texts:
            self.line(text)

    def indent(self) -> _Indent:
        return _Indent(self)

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


class _Indent:
    def __init__(self, writer: SourceWriter):
        self.writer = writer

    def __enter__(self) -> None:
        self.writer.depth += 1

    def __exit__(self, *exc) -> None:
        self.writer.depth -= 1


def size_names(func) -> list[str]:
    """The sizes a generated function takes: every name in the argument types,
    and the names the body uses that the caller binds (a decoder's cached
    length, a chunk's offsets)."""
    names = {d.symbol for a in func.args for d in a.type.shape if d.is_symbol}
    for op in func.body.walk():
        for value in op.results:
            for d in value.type.shape:
                names |= d.symbols()
        for attr in op.attrs.values():
            for item in attr if isinstance(attr, (list, tuple)) else [attr]:
                if isinstance(item, Dim):
                    names |= item.symbols()
    return sorted(names)


def dim_var(name: str) -> str:
    return f"d_{name}"


def dim_expr(value: Dim | int) -> str:
    """A dimension as a Python int expression over the ``d_NAME`` size variables."""
    text = str(dim(value))
    return re.sub(r"[A-Za-z_][A-Za-z0-9_]*", lambda m: dim_var(m.group()), text)


def literal(value: int | float | bool, dtype: str) -> str:
    if isinstance(value, bool) or dtype == "i1":
        return "True" if value else "False"
    if dtype.startswith("i"):
        return str(int(value))
    if math.isnan(value):
        text = "np.nan"
    elif math.isinf(value):
        text = "np.inf" if value > 0 else "-np.inf"
    else:
        text = repr(float(value))
    return f"{NUMPY_SCALAR[dtype]}({text})"


BINARY = {"ac.add": "+", "ac.sub": "-", "ac.mul": "*", "ac.floordiv": "//", "ac.mod": "%", "ac.pow": "**"}
COMPARE = {"lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!="}
UNARY_MATH = {
    "ac.exp": "math.exp",
    "ac.log": "math.log",
    "ac.tanh": "math.tanh",
    "ac.sqrt": "math.sqrt",
    "ac.sin": "math.sin",
    "ac.cos": "math.cos",
}


def choose(cond: str, a: str, b: str, select: str | None = None) -> str:
    """``a`` where ``cond`` holds, else ``b`` (both already computed): ``select(cond, a, b)`` where the
    generated code has such a function (no branch), else a conditional expression."""
    if select is not None:
        return f"{select}({cond}, {a}, {b})"
    return f"({a} if {cond} else {b})"


def select_min(a: str, b: str, select: str | None = None) -> str:
    """``min(a, b)`` as a choice (a NaN ``b`` is taken): a select, with no call or branch for LLVM's
    loop vectoriser to refuse, where Numba's builtin ``min`` of two scalars is a loop over its
    arguments (as cheap on a GPU); ``select``: :func:`choose`'s."""
    return choose(f"{a} < {b}", a, b, select)


def select_max(a: str, b: str, select: str | None = None) -> str:
    """``max(a, b)`` as a choice (see :func:`select_min`)."""
    return choose(f"{a} > {b}", a, b, select)


class ScalarEmitter:
    """Writes 0-d ops as assignments; ``names`` maps values to expressions.

    ``functions`` replaces the callables of the unary math ops (and of
    ``ac.rsqrt``, else ``1.0 / math.sqrt``; by ``("ac.div", dtype)``, a division of that type's
    own, called with both operands): the CUDA backend calls helpers
    that give ``log 0 = -inf`` and ``sqrt(-1) = nan`` explicitly, where
    Python's ``math`` (which Numba's CUDA simulator runs) raises.
    """

    def __init__(
        self,
        writer: SourceWriter,
        names: dict[Value, str],
        fresh: Callable[[str], str],
        array_ref: Callable[[Value], str],
        functions: dict[Any, str] | None = None,
        reciprocals: dict[Value, str] | None = None,
        integers: str | None = None,
        select: str | None = None,
        unsigned_gathers: bool = False,
    ):
        self.writer = writer
        #: gather indices written as ``np.uint64``: Numba adds no wrap-around of negative indices to
        #: them, so a gather along consecutive positions is a run of memory LLVM vectorises (every
        #: gather's indices are in range: ``gather_bounds`` proves them or checks them before a call)
        self.unsigned_gathers = unsigned_gathers
        #: a function ``select(c, a, b)`` of the generated code (both values computed, no branch) for
        #: ``ac.where``, ``ac.maximum`` and ``ac.minimum``, with ``&`` and ``|`` for ``ac.and`` and
        #: ``ac.or``; None: conditional expressions and ``and``/``or`` (see :func:`select_min`)
        self.select = select
        #: the type of integer results and sizes (None: ``NUMPY_SCALAR``'s, 64-bit); ``np.int32`` where
        #: a kernel's positions are 32-bit (a sequence is shorter than 2^31): one register, one compare
        self.integers = integers
        self.names = names
        self.fresh = fresh
        self.array_ref = array_ref
        self.functions = {**UNARY_MATH, **(functions or {})}
        #: divisors whose reciprocal a name holds: ``x / d`` is written ``x * (1 / d)``
        self.reciprocals = reciprocals or {}

    def ref(self, value: Value) -> str:
        if value in self.names:
            return self.names[value]
        if value.type.rank:
            return self.array_ref(value)
        raise KeyError(f"no expression for {value}")

    def typed(self, expr: str, dtype: str) -> str:
        if self.integers is not None and dtype in ("i32", "i64"):
            return f"{self.integers}({expr})"
        return f"{NUMPY_SCALAR[dtype]}({expr})"

    def op(self, op: Op) -> None:
        if op.name in ("ac.yield", "ac.return"):
            return
        out = op.results[0]
        dtype = out.type.dtype
        a = [self.ref(v) for v in op.operands]
        name = op.name
        if name == "ac.constant":
            expr = literal(op.attrs["value"], dtype)
        elif name == "ac.dim":
            expr = dim_expr(op.attrs["value"])
            expr = expr if self.integers is None else self.typed(expr, dtype)
        elif name in BINARY:
            expr = self.typed(f"{a[0]} {BINARY[name]} {a[1]}", dtype)
        elif name == "ac.div" and op.operands[1] in self.reciprocals:
            expr = self.typed(f"{a[0]} * {self.reciprocals[op.operands[1]]}", dtype)
        elif name == "ac.div" and ("ac.div", dtype) in self.functions:  # a division of this type's own
            expr = self.typed(f"{self.functions['ac.div', dtype]}({a[0]}, {a[1]})", dtype)
        elif name == "ac.div":
            expr = self.typed(f"{a[0]} / {a[1]}", dtype)
        elif name == "ac.neg":
            expr = self.typed(f"-{a[0]}", dtype)
        elif name == "ac.abs":
            expr = self.typed(f"abs({a[0]})", dtype)
        elif name in self.functions:  # a callable for the op in this type, else for the op
            expr = self.typed(f"{self.functions.get((name, dtype), self.functions[name])}({a[0]})", dtype)
        elif name == "ac.rsqrt":
            expr = self.typed(f"1.0 / math.sqrt({a[0]})", dtype)
        elif name in ("ac.maximum", "ac.minimum"):
            pick = (select_max if name == "ac.maximum" else select_min)(a[0], a[1], self.select)
            if is_float(dtype):  # NaN propagates, as in np.maximum
                pick = choose(f"{a[0]} != {a[0]}", a[0], pick, self.select)
            expr = self.typed(pick, dtype)
        elif name == "ac.cmp":
            expr = f"({a[0]} {COMPARE[op.attrs['pred']]} {a[1]})"
        elif name in ("ac.and", "ac.or"):  # of booleans: without a branch where ``select`` is given
            word = {"ac.and": ("and", "&"), "ac.or": ("or", "|")}[name][self.select is not None]
            expr = f"({a[0]} {word} {a[1]})"
        elif name == "ac.not":
            expr = f"(not {a[0]})"
        elif name == "ac.where":
            expr = self.typed(choose(a[0], a[1], a[2], self.select), dtype)
        elif name == "ac.cast":
            expr = f"({a[0]} != 0)" if dtype == "i1" else self.typed(a[0], dtype)
        elif name == "ac.random":  # the counters hashed one by one, the last cheaply (attncomp/ir/ops/random.py)
            state = "np.uint64(0)"
            for counter in a[:-1]:
                state = f"random_step({state}, np.uint64({counter}))"
            expr = f"random_unit({state}, np.uint64({a[-1]}))"
        elif name == "ac.gather":
            src = self.array_ref(op.operands[0])
            indices = [f"np.uint64({x})" for x in a[1:]] if self.unsigned_gathers else a[1:]
            expr = f"{src}[{', '.join(indices)}]"
            expr = self.typed(expr, dtype)
        else:
            raise NotImplementedError(f"no scalar lowering for {name}")
        var = self.fresh(out.name or "t")
        self.writer.line(f"{var} = {expr}")
        self.names[out] = var

    def block(self, block: Block, args: list[str]) -> list[str]:
        """Emit a region's ops with its arguments bound; return the yielded expressions."""
        for arg, expr in zip(block.args, args):
            self.names[arg] = expr
        for op in block.ops:
            self.op(op)
        return [self.ref(v) for v in block.ops[-1].operands]


class KernelSource:
    """What every kernel writer shares: the source lines, fresh local names, the
    kernel parameters standing for captured values, and 0-d ops as statements."""

    #: math functions for the scalar code, by op name or by (op name, type) (None: Python's ``math``)
    functions: dict[Any, str] | None = None
    #: gathers indexed by ``np.uint64`` indices (``ScalarEmitter.unsigned_gathers``)
    unsigned_gathers = False

    def __init__(self, captured: dict[Value, str], dims: list[str]):
        self.captured = captured  # outside value -> kernel parameter name
        self.dims = dims
        self.w = SourceWriter()
        self.counter = 0
        self.names: dict[Value, str] = {v: p for v, p in captured.items() if v.type.rank == 0}

    def fresh(self, hint: str) -> str:
        self.counter += 1
        safe = "".join(ch if ch.isalnum() else "_" for ch in hint)
        return f"{safe}_{self.counter}"

    def array_ref(self, value: Value) -> str:
        return self.captured[value]

    def page_view(self, load_op: Op) -> Op | None:
        """The ``ac.page_view`` a key or value tile load reads through, if any."""
        view = load_op.operands[0].owner
        return view if getattr(view, "name", None) == "ac.page_view" else None

    def page_row(self, load_op: Op, view: Op, row: str) -> tuple[str, str]:
        """Row ``row`` of a load through ``view`` in the pool: the page it is on (from the table:
        one table row per batch entry, or one table) and the index of the row's first element in
        the pages array after that page (``heads..., slot, ``)."""
        pages, table = self.array_ref(load_op.operands[0]), self.array_ref(view.operands[1])
        batch, *heads = (self.scalar().ref(v) for v in load_op.operands[1:-1])
        entry = f"{batch}, " if view.operands[1].type.rank == 2 else ""
        size = page_size(pages, view)
        return f"{table}[{entry}({row}) // {size}]", page_index(view, heads, f"({row}) % {size}")

    def by_tile_class(self, tiled, emit: Callable[[object, str | None], None], one_copy: bool = False) -> None:
        """The loop body of ``tiled`` (a TiledAttention or TiledBackward): its classification, then
        ``emit(tile, mask_when)``, where ``mask_when`` is the condition under which the tile's mask
        applies ("True": always, None: never).  Skipped tiles (class 0) do nothing.

        Two copies by default (the CPU's): the masked class (1) with its mask, the full class (2)
        without.  With ``one_copy`` (the GPU's, where a second copy costs registers and instruction
        cache) every computed tile runs one copy, the mask under ``tile_class == 1``: mask-elimination
        makes the full region the masked one with the mask replaced by ``true`` (docs/ir.md, 6.3).
        Without a classification, the loop's default class."""
        if tiled.tile_class is None:
            emit(tiled.masked, "True" if tiled.default_class == 1 else None)
            return
        for op in tiled.classify_ops:
            self.scalar().op(op)
        tile_class = self.scalar().ref(tiled.tile_class)
        if one_copy:
            self.w.line(f"if {tile_class} != 0:")
            with self.w.indent():
                emit(tiled.masked, f"{tile_class} == 1")
            return
        self.w.line(f"if {tile_class} == 1:")
        with self.w.indent():
            emit(tiled.masked, "True")
        self.w.line(f"elif {tile_class} == 2:")
        with self.w.indent():
            emit(tiled.full or tiled.masked, None)

    def scalar(self) -> ScalarEmitter:
        return ScalarEmitter(
            self.w, self.names, self.fresh, self.array_ref, self.functions, unsigned_gathers=self.unsigned_gathers
        )


def page_size(pages: str, view: Op) -> str:
    """The rows a page of an ``ac.page_view``'s pool ``pages`` holds, as an expression."""
    return f"{pages}.shape[{page_slot(view.attrs, view.operands[0].type.rank)}]"


def page_index(view: Op, heads: list[str], slot: str) -> str:
    """The index of a row's features in an ``ac.page_view``'s pool after its page: the heads and the
    ``slot`` in the pool's order (the slot after the heads, or first), with a trailing ", "."""
    at = list(heads)
    at.insert(page_slot(view.attrs, view.operands[0].type.rank) - 1, slot)
    return "".join(f"{a}, " for a in at)
