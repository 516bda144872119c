"""Tracing a spec into the graph IR.

``@ac.spec`` runs the function once on :class:`~attncomp.tensor.Tensor`
proxies; every operation emits an op.  Errors anywhere in the body become
``ac.SpecError`` naming the user's file and line.  The traced values are named
after the variables they are assigned to, so ``print(spec.ir)`` and the
interpreter's trace speak the spec's own words.
"""

from __future__ import annotations

import ast
import inspect
import os
import sys
import textwrap
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from attncomp.errors import SpecError, TypeCheckError, with_location
from attncomp.ir.core import Block, Func, Location, Module, Op, Value
from attncomp.ir.dims import Dim, dim
from attncomp.ir.graph import remove_dead_ops
from attncomp.ir.ops import OP_DEFS, Checker
from attncomp.ir.ops.elementwise import promote
from attncomp.ir.types import CACHE_DTYPES, TensorType, is_float, weak_float_dtype
from attncomp.names import name_values
from attncomp.passes.patterns import producer, softmax_division
from attncomp.tensor import SymDim, Tensor

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
RESERVED_DIM_NAMES = {
    *("x", "tensor", "inf", "nan", "true", "false", "floating"),
    *("f16", "bf16", "f32", "f64", "i1", "i32", "i64", "f8e4m3", "f8e5m2"),
}
#: the element type of ``ac.floating`` arguments: the float type of the call
GENERIC = "floating"
#: the float type a generic spec's own IR (``spec.ir``) is traced with
DEFAULT_FLOAT = "f32"


# annotations ------------------------------------------------------------------
@dataclass(frozen=True)
class TensorSpec:
    """An argument annotation such as ``ac.f32["B", "H", "T", "D"]``."""

    dtype: str
    dims: tuple[str | int, ...]

    def type(self, float_type: str = DEFAULT_FLOAT) -> TensorType:
        """The argument's type; ``ac.floating`` takes ``float_type``."""
        return TensorType.of(self.dims, float_type if self.dtype == GENERIC else self.dtype)

    def __repr__(self) -> str:
        return f"{self.dtype}{list(self.dims)}"


@dataclass(frozen=True)
class DType:
    """An element type; subscript it with dimension names or sizes."""

    name: str

    def __getitem__(self, dims: Any) -> TensorSpec:
        if not isinstance(dims, tuple):
            dims = (dims,)
        for d in dims:
            if isinstance(d, bool) or not isinstance(d, (str, int)):
                raise SpecError(f"{self.name}[...]: a dimension is a name or a size, got {d!r}")
            if isinstance(d, int) and d < 0:
                raise SpecError(f"{self.name}[...]: a size must not be negative, got {d}")
            if isinstance(d, str) and (not d.isidentifier() or d in RESERVED_DIM_NAMES):
                raise SpecError(f"{self.name}[...]: {d!r} cannot name a dimension")
        return TensorSpec(self.name, tuple(dims))

    def __repr__(self) -> str:
        return f"ac.{self.name}"


f16, bf16, f32, f64 = DType("f16"), DType("bf16"), DType("f32"), DType("f64")
#: any float type: the call's (docs/api.md section 9)
floating = DType(GENERIC)
i32, i64, bool_ = DType("i32"), DType("i64"), DType("i1")
#: 8-bit float types a key/value cache may store (``fn.decoder(max_len, cache=ac.f8e4m3)``), not a
#: spec's arguments
f8e4m3, f8e5m2 = DType("f8e4m3"), DType("f8e5m2")


# the tracer ---------------------------------------------------------------------
def user_location() -> Location | None:
    """The innermost stack frame outside this package: the user's line."""
    frame = sys._getframe(1)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith(_PACKAGE_DIR + os.sep):
            return Location(frame.f_code.co_filename, frame.f_lineno)
        frame = frame.f_back
    return None


def _with_location(message: str, loc: Location | None) -> str:
    return with_location(message, None if loc is None else str(loc))


#: ops whose operands do not meet as numbers: a cast sets its type, a gather's indices address
NOT_MEETING = frozenset({"ac.cast", "ac.gather"})


class Tracer:
    """Emits one op per traced operation.

    Python scalars are weak (docs/ir.md, "Weak scalars"): a Python float, and a value made only
    from such scalars, positions and sizes, is traced in ``weak_float`` (float32, or float64 in a
    float64 spec) and takes the type of the float tensor it meets, so it never widens one.
    """

    def __init__(self, name: str, weak_float: str = "f32"):
        self.func = Func(name, Block())
        self.checker = Checker()
        self.weak_float = weak_float
        #: the weak float values traced so far
        self.weak: set[Value] = set()
        #: (weak value, type) -> the value in that type, so that each is cast once
        self.met: dict[tuple[Value, str], Tensor] = {}

    def located(self, error: SpecError) -> SpecError:
        if getattr(error, "located", False):
            return error
        located = SpecError(_with_location(str(error), user_location()))
        located.located = True  # type: ignore[attr-defined]
        return located

    def add_arg(self, name: str, type: TensorType) -> Tensor:
        return Tensor(self, self.func.body.add_arg(type, name))

    def emit(
        self,
        name: str,
        operands: list[Tensor],
        attrs: dict[str, Any] | None = None,
        declared: list[TensorType] | None = None,
    ) -> Tensor:
        attrs = attrs or {}
        if name not in NOT_MEETING:
            operands = self.meet(operands)
        values = [t.value for t in operands]
        try:
            types = OP_DEFS[name].infer([v.type for v in values], attrs, declared, self.checker)
        except TypeCheckError as exc:
            raise self.located(SpecError(str(exc))) from None
        op = Op.create(name, values, types, attrs, loc=user_location())
        self.func.body.ops.append(op)
        floats = [v for v in values if is_float(v.type.dtype)]
        if operands and name != "ac.cast" and is_float(op.result.type.dtype) and all(v in self.weak for v in floats):
            self.weak.add(op.result)  # made only from weak floats, positions and sizes
        return Tensor(self, op.result)

    def meet(self, operands: list[Tensor]) -> list[Tensor]:
        """Weak float operands in the type of the strong float operands they meet, where they would
        otherwise decide the result's type (a weak constant is traced again in that type)."""
        floats = [t for t in operands if is_float(t.dtype)]
        strong = [t.type for t in floats if t.value not in self.weak]
        if not strong or len(strong) == len(floats):
            return operands
        target = promote(strong)
        if promote([t.type for t in floats]) == target:
            return operands
        return [self.retyped(t, target) if t.value in self.weak and t.dtype != target else t for t in operands]

    def retyped(self, weak: Tensor, dtype: str) -> Tensor:
        key = (weak.value, dtype)
        if key not in self.met:
            op = weak.value.owner
            if isinstance(op, Op) and op.name == "ac.constant" and weak.ndim == 0:
                self.met[key] = self.constant(op.attrs["value"], dtype)
            else:
                self.met[key] = self.emit("ac.cast", [weak], declared=[weak.type.with_dtype(dtype)])
        return self.met[key]

    def matmul(self, a: Tensor, b: Tensor) -> Tensor:
        """``a @ b``; probabilities meeting narrower values give the values' type (docs/ir.md,
        "The attention's types"): ``softmax(s) @ v`` is ``v``'s type whatever widened the scores."""
        product = self.emit("ac.matmul", [a, b])
        if is_probabilities(a.value) and is_float(b.dtype) and product.dtype != b.dtype:
            return self.emit("ac.cast", [product], declared=[product.type.with_dtype(b.dtype)])
        return product

    def lift(self, value: Any) -> Tensor:
        """A Tensor for a tensor, size or Python scalar operand."""
        if isinstance(value, Tensor):
            if value.tracer is not self:
                raise self.located(SpecError("a tensor from another spec's trace was used here"))
            return value
        if isinstance(value, SymDim):
            return value.tensor()
        if isinstance(value, bool):
            return self.constant(value, "i1")
        if isinstance(value, int):
            return self.constant(value, "i64")
        if isinstance(value, float):
            weak = self.constant(value, self.weak_float)
            self.weak.add(weak.value)
            return weak
        raise self.located(SpecError(f"cannot use {type(value).__name__} {value!r} in a spec"))

    def constant(self, value: int | float | bool, dtype: str) -> Tensor:
        return self.emit("ac.constant", [], {"value": value}, declared=[TensorType((), dtype)])

    def axis(self, axis: Any, rank: int) -> int:
        if isinstance(axis, bool) or not isinstance(axis, int):
            raise self.located(SpecError(f"an axis must be an int, got {axis!r}"))
        if not -rank <= axis < rank:
            raise self.located(SpecError(f"axis {axis} is out of range for a tensor of rank {rank}"))
        return axis % rank

    def axes(self, axis: Any, rank: int) -> list[int]:
        if axis is None:
            return list(range(rank))
        items = axis if isinstance(axis, (tuple, list)) else [axis]
        return sorted({self.axis(a, rank) for a in items})

    def reduce(self, x: Any, kind: str, axis: Any, keepdims: bool) -> Tensor:
        x = self.lift(x)
        attrs = {"kind": kind, "axes": self.axes(axis, x.ndim), "keepdims": bool(keepdims)}
        return self.emit("ac.reduce", [x], attrs)

    def size(self, value: Any) -> Dim:
        if isinstance(value, SymDim):
            return value.dim
        if isinstance(value, int) and not isinstance(value, bool):
            return dim(value)
        raise self.located(SpecError(f"a size must be an int or x.shape[k], got {value!r}"))

    def reshape(self, x: Tensor, shape: tuple[Any, ...]) -> Tensor:
        total = _product(x.type.shape)
        sizes: list[Dim | None] = []
        for s in shape:
            sizes.append(None if isinstance(s, int) and not isinstance(s, bool) and s == -1 else self.size(s))
        if sizes.count(None) > 1:
            raise self.located(SpecError("reshape: at most one size may be -1"))
        if None in sizes:
            known = _product([s for s in sizes if s is not None])
            sizes[sizes.index(None)] = total // known
        new_type = x.type.with_shape(sizes)
        if new_type == x.type:
            return x
        return self.emit("ac.reshape", [x], declared=[new_type])

    def index(self, x: Tensor, key: Any) -> Tensor:
        key = key if isinstance(key, tuple) else (key,)
        if any(isinstance(k, Tensor) for k in key):
            return self.gather(x, key)
        return self.basic_index(x, key)

    def gather(self, x: Tensor, key: tuple[Any, ...]) -> Tensor:
        if any(isinstance(k, (slice, type(Ellipsis))) or k is None for k in key):
            raise self.located(
                SpecError("gathering needs one index tensor per axis; slices and ... cannot be mixed in")
            )
        return self.emit("ac.gather", [x] + [self.lift(k) for k in key])

    def basic_index(self, x: Tensor, key: tuple[Any, ...]) -> Tensor:
        if sum(k is Ellipsis for k in key) > 1:
            raise self.located(SpecError("an index may hold at most one ..."))
        used = sum(1 for k in key if k is not None and k is not Ellipsis)
        if used > x.ndim:
            raise self.located(SpecError(f"too many indices ({used}) for a tensor of rank {x.ndim}"))
        if Ellipsis in key:
            at = key.index(Ellipsis)
            key = key[:at] + (slice(None),) * (x.ndim - used) + key[at + 1 :]
        else:
            key = key + (slice(None),) * (x.ndim - used)
        result, axis, final = x, 0, []
        for k in key:
            if k is None:
                final.append(dim(1))
                continue
            size = x.type.shape[axis]
            if isinstance(k, slice):
                start, stop, step = self.slice_bounds(k, size)
                if not (start == dim(0) and stop == size and step == 1):
                    result = self.emit("ac.slice", [result], {"axis": axis, "start": start, "stop": stop, "step": step})
                final.append(result.type.shape[axis])
            else:
                start = self.bound(k, size)
                result = self.emit("ac.slice", [result], {"axis": axis, "start": start, "stop": start + 1, "step": 1})
            axis += 1
        if tuple(final) != result.type.shape:
            result = self.emit("ac.reshape", [result], declared=[result.type.with_shape(final)])
        return result

    def bound(self, value: Any, size: Dim) -> Dim:
        """A slice bound as a dimension in [0, size]; negative ints count from the end."""
        d = self.size(value)
        if d.is_const and d.value < 0:
            d = size + d
        if d.is_const and size.is_const:
            d = dim(min(max(d.value, 0), size.value))
        return d

    def slice_bounds(self, k: slice, size: Dim) -> tuple[Dim, Dim, int]:
        step = 1 if k.step is None else k.step
        if isinstance(step, bool) or not isinstance(step, int) or step <= 0:
            raise self.located(SpecError(f"slice step must be a positive int, got {k.step!r}"))
        start = dim(0) if k.start is None else self.bound(k.start, size)
        stop = size if k.stop is None else self.bound(k.stop, size)
        return start, stop, step

    def finish(self, result: Any, constants: dict[str, Any]) -> Module:
        outputs = list(result) if isinstance(result, (tuple, list)) else [result]
        if not outputs:
            raise SpecError(f"spec {self.func.name} returns nothing")
        for k, out in enumerate(outputs):
            if not isinstance(out, Tensor):
                raise SpecError(f"spec {self.func.name} must return tensors; result {k} is {type(out).__name__}")
        self.func.body.ops.append(Op.create("ac.return", [t.value for t in outputs], []))
        self.func.attrs = {k: v for k, v in constants.items() if _is_attr_value(v)}
        name_values(self.func)
        remove_dead_ops(self.func.body)
        return Module([self.func])


def is_probabilities(value: Value) -> bool:
    """Whether ``value`` is a softmax along the last axis, as ``ac.softmax`` or spelled out."""
    op = producer(value)
    if op is not None and op.name == "ac.softmax":
        return op.attrs["axis"] == value.type.rank - 1
    return op is not None and softmax_division(op) is not None


def _product(dims) -> Dim:
    total = dim(1)
    for d in dims:
        total = total * d
    return total


def _is_attr_value(v: Any) -> bool:
    return isinstance(v, (int, float, str, bool))


# specs ----------------------------------------------------------------------------
class Spec:
    """A traced attention spec.  ``spec.ir`` is its graph IR (with default constants)."""

    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn
        self.name = fn.__name__
        self.__doc__ = fn.__doc__
        self.__wrapped__ = fn
        self.params, self.constants = _signature(fn)
        #: the positions of the ``ac.floating`` arguments: a generic spec has some
        self.float_args = [k for k, (_, ann) in enumerate(self.params) if ann.dtype == GENERIC]
        self._ir = self.trace()

    @property
    def ir(self) -> Module:
        return self._ir

    @property
    def arg_names(self) -> list[str]:
        return [name for name, _ in self.params]

    @property
    def generic(self) -> bool:
        """Whether some argument is ``ac.floating``: the spec then serves every float type."""
        return bool(self.float_args)

    def trace(self, **constants: Any) -> Module:
        """Trace again with keyword constants overriding the defaults."""
        return self.trace_as(DEFAULT_FLOAT, **constants)

    def trace_as(self, float_type: str, **constants: Any) -> Module:
        """Trace with ``ac.floating`` arguments of ``float_type`` (and keyword constants)."""
        unknown = set(constants) - set(self.constants)
        if unknown:
            valid = ", ".join(self.constants) or "none"
            raise TypeError(f"{self.name}: unknown constant(s) {', '.join(sorted(unknown))}; valid: {valid}")
        values = {**self.constants, **constants}
        types = [spec.type(float_type) for _, spec in self.params]
        tracer = Tracer(self.name, weak_float_dtype([t.dtype for t in types]))
        args = [tracer.add_arg(name, t) for (name, _), t in zip(self.params, types)]
        try:
            result = self.fn(*args, **values)
        except SpecError as exc:
            raise tracer.located(exc) from None
        except Exception as exc:  # any Python failure in the body is the user's line
            loc = _failing_location(exc)
            message = f"{type(exc).__name__}: {exc}"
            raise SpecError(_with_location(message, loc)) from exc
        try:
            return tracer.finish(result, values)
        except SpecError as exc:
            raise SpecError(_with_location(str(exc), _return_location(self.fn))) from None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if any(isinstance(a, Tensor) for a in args):
            return self.fn(*args, **{**self.constants, **kwargs})
        raise TypeError(
            f"spec {self.name} is not called directly: use ac.compile({self.name}) or ac.interpret({self.name}, ...)"
        )

    def __repr__(self) -> str:
        return f"<attncomp spec {self.name}({', '.join(self.arg_names)})>"


def _failing_location(exc: BaseException) -> Location | None:
    frames = traceback.extract_tb(exc.__traceback__)
    for fs in reversed(frames):
        path = os.path.abspath(fs.filename)
        if not path.startswith(_PACKAGE_DIR + os.sep):
            return Location(fs.filename, fs.lineno or 0)
    return None


def _definition(fn: Callable[..., Any]) -> tuple[ast.FunctionDef | ast.AsyncFunctionDef | None, int]:
    """The syntax tree of ``fn``'s def and what to add to its line numbers (None without source)."""
    try:
        lines, first = inspect.getsourcelines(fn)
        tree = ast.parse(textwrap.dedent("".join(lines)))
    except (OSError, TypeError, SyntaxError):
        return None, 0
    node = tree.body[0] if tree.body else None
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None, 0
    return node, first - 1


def _def_location(fn: Callable[..., Any], param: str | None = None) -> Location:
    """The line of ``fn``'s parameter ``param``, or of its def (not its decorator)."""
    node, offset = _definition(fn)
    if node is None:
        return Location(fn.__code__.co_filename, fn.__code__.co_firstlineno)
    a = node.args
    for arg in [*a.posonlyargs, *a.args, a.vararg, *a.kwonlyargs, a.kwarg]:
        if arg is not None and arg.arg == param:
            return Location(fn.__code__.co_filename, arg.lineno + offset)
    return Location(fn.__code__.co_filename, node.lineno + offset)


def _own_nodes(node: ast.AST):
    """The nodes of a function body, not descending into nested functions or classes."""
    for child in ast.iter_child_nodes(node):
        if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            yield child
            yield from _own_nodes(child)


def _return_location(fn: Callable[..., Any]) -> Location:
    """The line of ``fn``'s return statement, or of its def when it has none or several."""
    node, offset = _definition(fn)
    returns = [n for n in _own_nodes(node) if isinstance(n, ast.Return)] if node else []
    if len(returns) != 1:
        return _def_location(fn)
    return Location(fn.__code__.co_filename, returns[0].lineno + offset)


def _signature(fn: Callable[..., Any]) -> tuple[list[tuple[str, TensorSpec]], dict[str, Any]]:
    def error(message: str, param: str | None = None) -> SpecError:
        return SpecError(_with_location(message, _def_location(fn, param)))

    try:
        sig = inspect.signature(fn, eval_str=True)
    except Exception as exc:
        raise error(f"cannot read the signature of {fn.__name__}: {exc}") from exc
    params: list[tuple[str, TensorSpec]] = []
    constants: dict[str, Any] = {}
    for p in sig.parameters.values():
        if p.kind is inspect.Parameter.KEYWORD_ONLY:
            if p.default is inspect.Parameter.empty:
                raise error(f"compile-time constant '{p.name}' needs a default value", p.name)
            constants[p.name] = p.default
        elif p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
            ann = p.annotation
            if isinstance(ann, DType):
                ann = TensorSpec(ann.name, ())
            if not isinstance(ann, TensorSpec):
                raise error(
                    f"argument '{p.name}' needs a tensor annotation such as "
                    f'ac.f32["B", "T", "D"] (keyword-only arguments are compile-time constants)',
                    p.name,
                )
            if ann.dtype in CACHE_DTYPES:
                raise error(
                    f"argument '{p.name}': ac.{ann.dtype} is the element type of an 8-bit key/value cache "
                    f"(fn.decoder(max_len, cache=ac.{ann.dtype})), not of a spec's argument",
                    p.name,
                )
            params.append((p.name, ann))
        else:
            raise error("*args and **kwargs are not supported in a spec", p.name)
    return params, constants


def spec(fn: Callable[..., Any]) -> Spec:
    """Trace ``fn`` into the graph IR (see docs/api.md section 1)."""
    return Spec(fn)
