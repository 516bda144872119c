"""The proxies a spec body computes with while it is traced.

A :class:`Tensor` stands for an IR value; its operators emit ops.  A
:class:`SymDim` is a symbolic size from ``x.shape``: integer arithmetic on
sizes stays symbolic, anything else turns it into a 0-d tensor.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from attncomp.errors import SpecError
from attncomp.ir.core import Value
from attncomp.ir.dims import Dim, dim
from attncomp.ir.types import TensorType

if TYPE_CHECKING:
    from attncomp.dsl import Tracer

_I64_SCALAR = TensorType((), "i64")


def _no_python_value(what: str) -> SpecError:
    return SpecError(
        f"{what} needs a concrete value, but tensors only have values when the compiled "
        "function runs (a Python if/while/and/or/not, int() or float() on a tensor "
        "depends on data); use ac.where for data-dependent choices"
    )


class Tensor:
    """A traced value.  Supports the operations listed in docs/api.md section 1."""

    __array_priority__ = 1000

    def __init__(self, tracer: Tracer, value: Value):
        self.tracer = tracer
        self.value = value

    # introspection ------------------------------------------------------
    @property
    def type(self):
        return self.value.type

    @property
    def shape(self) -> tuple[SymDim, ...]:
        return tuple(SymDim(self.tracer, d) for d in self.type.shape)

    @property
    def ndim(self) -> int:
        return self.type.rank

    @property
    def dtype(self) -> str:
        return self.type.dtype

    def __repr__(self) -> str:
        return f"<traced {self.type}>"

    __hash__ = object.__hash__

    # things a traced value cannot do -------------------------------------
    def __bool__(self):
        raise self.tracer.located(_no_python_value("truth value of a tensor"))

    def __float__(self):
        raise self.tracer.located(_no_python_value("float() of a tensor"))

    def __int__(self):
        raise self.tracer.located(_no_python_value("int() of a tensor"))

    __index__ = __int__

    def __len__(self):
        raise self.tracer.located(SpecError("len() of a tensor: use x.shape[0]"))

    def __iter__(self):
        raise self.tracer.located(SpecError("iterating over a tensor is not supported"))

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        raise self.tracer.located(SpecError(f"numpy's {ufunc.__name__} cannot trace a tensor; use the ac. function"))

    def __array_function__(self, func, types, args, kwargs):
        raise self.tracer.located(SpecError(f"numpy's {func.__name__} cannot trace a tensor; use the ac. function"))

    # arithmetic ---------------------------------------------------------
    def _binary(self, name: str, other: Any, reverse: bool = False, **attrs) -> Tensor:
        other = self.tracer.lift(other)
        a, b = (other, self) if reverse else (self, other)
        return self.tracer.emit(name, [a, b], attrs)

    def __add__(self, o):
        return self._binary("ac.add", o)

    def __radd__(self, o):
        return self._binary("ac.add", o, True)

    def __sub__(self, o):
        return self._binary("ac.sub", o)

    def __rsub__(self, o):
        return self._binary("ac.sub", o, True)

    def __mul__(self, o):
        return self._binary("ac.mul", o)

    def __rmul__(self, o):
        return self._binary("ac.mul", o, True)

    def __truediv__(self, o):
        return self._binary("ac.div", o)

    def __rtruediv__(self, o):
        return self._binary("ac.div", o, True)

    def __floordiv__(self, o):
        return self._binary("ac.floordiv", o)

    def __rfloordiv__(self, o):
        return self._binary("ac.floordiv", o, True)

    def __mod__(self, o):
        return self._binary("ac.mod", o)

    def __rmod__(self, o):
        return self._binary("ac.mod", o, True)

    def __pow__(self, o):
        return self._binary("ac.pow", o)

    def __rpow__(self, o):
        return self._binary("ac.pow", o, True)

    def __matmul__(self, o):
        return self.tracer.matmul(self, self.tracer.lift(o))

    def __rmatmul__(self, o):
        return self.tracer.matmul(self.tracer.lift(o), self)

    def __neg__(self):
        return self.tracer.emit("ac.neg", [self])

    def __pos__(self):
        return self

    def __abs__(self):
        return self.tracer.emit("ac.abs", [self])

    # comparisons and logic ------------------------------------------------
    def __lt__(self, o):
        return self._binary("ac.cmp", o, pred="lt")

    def __le__(self, o):
        return self._binary("ac.cmp", o, pred="le")

    def __gt__(self, o):
        return self._binary("ac.cmp", o, pred="gt")

    def __ge__(self, o):
        return self._binary("ac.cmp", o, pred="ge")

    def __eq__(self, o):  # type: ignore[override]
        return self._binary("ac.cmp", o, pred="eq")

    def __ne__(self, o):  # type: ignore[override]
        return self._binary("ac.cmp", o, pred="ne")

    def __and__(self, o):
        return self._binary("ac.and", o)

    def __rand__(self, o):
        return self._binary("ac.and", o, True)

    def __or__(self, o):
        return self._binary("ac.or", o)

    def __ror__(self, o):
        return self._binary("ac.or", o, True)

    def __invert__(self):
        return self.tracer.emit("ac.not", [self])

    # layout -------------------------------------------------------------
    @property
    def mT(self) -> Tensor:
        if self.ndim < 2:
            raise self.tracer.located(SpecError(f".mT needs rank >= 2, got rank {self.ndim}"))
        perm = list(range(self.ndim))
        perm[-2], perm[-1] = perm[-1], perm[-2]
        return self.tracer.emit("ac.transpose", [self], {"perm": perm})

    @property
    def T(self) -> Tensor:
        return self.transpose(*reversed(range(self.ndim)))

    def transpose(self, *axes: int) -> Tensor:
        """A full permutation, or two axes to swap (as ``torch.transpose``)."""
        if len(axes) == 1 and isinstance(axes[0], (tuple, list)):
            axes = tuple(axes[0])
        rank = self.ndim
        if len(axes) == rank and sorted(a % rank for a in axes) == list(range(rank)):
            perm = [a % rank for a in axes]
        elif len(axes) == 2:
            perm = list(range(rank))
            a, b = (self.tracer.axis(x, rank) for x in axes)
            perm[a], perm[b] = perm[b], perm[a]
        else:
            raise self.tracer.located(
                SpecError(f"transpose{axes}: give a permutation of {rank} axes or two axes to swap")
            )
        if perm == list(range(rank)):
            return self
        return self.tracer.emit("ac.transpose", [self], {"perm": perm})

    def reshape(self, *shape: Any) -> Tensor:
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        return self.tracer.reshape(self, shape)

    def astype(self, dtype: Any) -> Tensor:
        name = getattr(dtype, "name", dtype)
        if name == self.dtype:
            return self
        return self.tracer.emit("ac.cast", [self], declared=[self.type.with_dtype(name)])

    def __getitem__(self, key: Any) -> Tensor:
        return self.tracer.index(self, key)

    # reductions as methods -------------------------------------------------
    def sum(self, axis=None, keepdims: bool = False) -> Tensor:
        return self.tracer.reduce(self, "sum", axis, keepdims)

    def max(self, axis=None, keepdims: bool = False) -> Tensor:
        return self.tracer.reduce(self, "max", axis, keepdims)

    def min(self, axis=None, keepdims: bool = False) -> Tensor:
        return self.tracer.reduce(self, "min", axis, keepdims)

    def mean(self, axis=None, keepdims: bool = False) -> Tensor:
        return self.tracer.reduce(self, "mean", axis, keepdims)


class SymDim:
    """A size from ``x.shape``: symbolic while tracing."""

    def __init__(self, tracer: Tracer, value: Dim):
        self.tracer = tracer
        self.dim = value

    def __repr__(self) -> str:
        return f"<size {self.dim}>"

    def tensor(self) -> Tensor:
        """This size as a 0-d i64 tensor."""
        return self.tracer.emit("ac.dim", [], {"value": self.dim}, declared=[_I64_SCALAR])

    def _dim_op(self, other: Any, fn) -> SymDim | Tensor | None:
        if isinstance(other, SymDim):
            return SymDim(self.tracer, fn(self.dim, other.dim))
        if isinstance(other, int) and not isinstance(other, bool):
            return SymDim(self.tracer, fn(self.dim, dim(other)))
        return None

    def _arith(self, o: Any, dim_fn, tensor_fn) -> SymDim | Tensor:
        result = self._dim_op(o, dim_fn)
        return result if result is not None else tensor_fn(self.tensor(), o)

    def __add__(self, o):
        return self._arith(o, lambda a, b: a + b, lambda t, o: t + o)

    def __radd__(self, o):
        return self._arith(o, lambda a, b: b + a, lambda t, o: o + t)

    def __sub__(self, o):
        return self._arith(o, lambda a, b: a - b, lambda t, o: t - o)

    def __rsub__(self, o):
        return self._arith(o, lambda a, b: b - a, lambda t, o: o - t)

    def __mul__(self, o):
        return self._arith(o, lambda a, b: a * b, lambda t, o: t * o)

    def __rmul__(self, o):
        return self._arith(o, lambda a, b: b * a, lambda t, o: o * t)

    def __floordiv__(self, o):
        return self._arith(o, lambda a, b: a // b, lambda t, o: t // o)

    def __rfloordiv__(self, o):
        return self._arith(o, lambda a, b: b // a, lambda t, o: o // t)

    def __truediv__(self, o):
        return self.tensor() / o

    def __rtruediv__(self, o):
        return o / self.tensor()

    def __pow__(self, o):
        return self.tensor() ** o

    def __rpow__(self, o):
        return o ** self.tensor()

    def __neg__(self):
        return SymDim(self.tracer, -self.dim)

    def __int__(self) -> int:
        if self.dim.is_const:
            return self.dim.value
        raise self.tracer.located(
            SpecError(f"size {self.dim} is symbolic: it is only known when the compiled function runs")
        )

    __index__ = __int__

    def __bool__(self):
        raise self.tracer.located(_no_python_value(f"a Python test on size {self.dim}"))

    def _compare(self, o, what: str):
        raise self.tracer.located(_no_python_value(f"comparing size {self.dim} ({what})"))

    def __eq__(self, o):  # type: ignore[override]
        if isinstance(o, SymDim) and o.dim == self.dim:
            return True
        return self._compare(o, "==")

    def __ne__(self, o):  # type: ignore[override]
        if isinstance(o, SymDim) and o.dim == self.dim:
            return False
        return self._compare(o, "!=")

    def __lt__(self, o):
        return self._compare(o, "<")

    __le__ = __lt__
    __gt__ = __lt__
    __ge__ = __lt__
    __hash__ = object.__hash__
