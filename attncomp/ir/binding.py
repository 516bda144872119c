"""Binding call arguments to a function's symbolic sizes, before any work is done."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from attncomp.errors import ShapeError
from attncomp.ir.core import Func
from attncomp.ir.ops import DimConstraint
from attncomp.ir.types import NUMPY_DTYPES, TensorType, category, dtype_of_numpy


def as_array(value: Any, name: str) -> np.ndarray:
    if isinstance(value, np.ndarray):
        return value
    if is_torch_tensor(value):
        return tensor_array(value, name)
    if hasattr(value, "__array__") or isinstance(value, (int, float, bool, list, tuple)):
        return np.asarray(value)
    if hasattr(value, "__dlpack__"):
        return np.from_dlpack(value)
    raise TypeError(f"{name}: expected an array, got {type(value).__name__}")


def is_torch_tensor(value: Any) -> bool:
    """Whether ``value`` is a torch tensor (told by its type's package: torch is never imported here)."""
    return type(value).__module__.split(".")[0] == "torch"


def tensor_array(value: Any, name: str) -> np.ndarray:
    """A CPU torch tensor as a numpy array over its memory (bf16: its 16-bit patterns viewed as
    ml_dtypes' bfloat16, the only one numpy knows); a tensor elsewhere, or one that requires grad
    (a call computes no gradient: ``fn.to_torch()`` does), is refused naming the argument."""
    import torch  # loaded already: value is one of its tensors

    if value.device.type != "cpu":
        raise ValueError(f"{name}: a {value.device.type} tensor, but this function reads host arrays")
    refuse_grad(value, name)
    if value.dtype == torch.bfloat16:
        return value.view(torch.int16).numpy().view(NUMPY_DTYPES["bf16"])
    return value.numpy()


def refuse_grad(tensor: Any, name: str) -> None:
    """A ``TypeError`` naming the argument if ``tensor`` requires grad: a call computes no gradient."""
    if tensor.requires_grad:
        raise TypeError(
            f"{name}: a tensor that requires grad, but a call computes no gradient "
            f"(fn.to_torch() does; or pass {name}.detach())"
        )


def check_dtype(array: np.ndarray, want: str, name: str) -> None:
    """Accept the declared element type or one that converts to it without loss."""
    got = dtype_of_numpy(array.dtype)
    ok = got is not None and (
        got == want or category(got) == category(want) and np.can_cast(array.dtype, NUMPY_DTYPES[want], casting="safe")
    )
    if not ok:
        raise TypeError(
            f"{name}: expected {want} ({np.dtype(NUMPY_DTYPES[want]).name}) elements, got {array.dtype.name}"
        )


def bind_arguments(
    func: Func,
    args: Sequence[Any],
    constraints: Sequence[DimConstraint] = (),
    sizes: dict[str, int] | None = None,
) -> tuple[list[np.ndarray], dict[str, int]]:
    """Check the arguments against ``func``'s signature; return arrays and sizes.

    ``sizes`` are dimensions the caller knows (a decoder's cached length).
    Raises ``TypeError`` for a wrong count or element type and ``ShapeError``
    for a wrong rank or size, naming the argument and the dimension.
    """
    names = [a.name or f"arg{k}" for k, a in enumerate(func.args)]
    if len(args) != len(func.args):
        raise TypeError(f"@{func.name} takes {len(func.args)} arguments ({', '.join(names)}), got {len(args)}")
    arrays = [as_array(value, name) for value, name in zip(args, names)]
    env = bind_shapes(func.args, arrays, sizes)
    for c in constraints:
        lhs, rhs = _eval_or_fail(c.lhs, env, c), _eval_or_fail(c.rhs, env, c)
        if c.relation == "le" and lhs > rhs:
            raise ShapeError(
                f"sizes {_sizes(c.lhs.symbols() | c.rhs.symbols(), env)} do not fit the spec: "
                f"{_shown(c.lhs, lhs)} exceeds {_shown(c.rhs, rhs)} ({c.reason})"
            )
        if c.relation == "eq" and lhs != rhs:
            raise ShapeError(
                f"sizes {_sizes(c.lhs.symbols() | c.rhs.symbols(), env)} do not fit the spec: "
                f"{c.lhs} = {lhs} but {c.rhs} = {rhs} ({c.reason})"
            )
    return arrays, env


def bind_shapes(
    args: Sequence[Any], arrays: Sequence[np.ndarray], sizes: dict[str, int] | None = None
) -> dict[str, int]:
    """Check element types and shapes of ``arrays`` against argument values ``args``; return the sizes."""
    env: dict[str, int] = dict(sizes or {})
    bound_by: dict[str, str] = {name: "the caller" for name in env}
    for k, (array, arg) in enumerate(zip(arrays, args)):
        name = arg.name or f"arg{k}"
        check_dtype(array, arg.type.dtype, name)
        _bind_shape(array, arg.type, name, env, bound_by)
    for k, (array, arg) in enumerate(zip(arrays, args)):
        for axis, (size, d) in enumerate(zip(array.shape, arg.type.shape)):
            if not (d.is_const or d.is_symbol) and d.evaluate(env) != size:
                name = arg.name or f"arg{k}"
                raise ShapeError(f"{name}: dimension {axis} is {size}, but {d} = {d.evaluate(env)}")
    return env


def _bind_shape(
    array: np.ndarray, declared: TensorType, name: str, env: dict[str, int], bound_by: dict[str, str]
) -> None:
    if array.ndim != declared.rank:
        dims = ", ".join(map(str, declared.shape))
        raise ShapeError(
            f"{name}: expected rank {declared.rank} ({dims}), got rank {array.ndim} with shape {tuple(array.shape)}"
        )
    for axis, (size, d) in enumerate(zip(array.shape, declared.shape)):
        if d.is_const:
            if size != d.value:
                raise ShapeError(f"{name}: dimension {axis} must be {d.value}, got {size}")
            continue
        if not d.is_symbol:  # an expression of names other arguments bind: checked after them
            continue
        symbol = d.symbol
        if symbol not in env:
            env[symbol] = int(size)
            bound_by[symbol] = name
        elif env[symbol] != size:
            raise ShapeError(
                f"{name}: dimension {symbol} is {size}, but {bound_by[symbol]} gave {symbol} = {env[symbol]}"
            )


def _eval_or_fail(d, env: dict[str, int], c: DimConstraint) -> int:
    try:
        return d.evaluate(env)
    except ZeroDivisionError:
        raise ShapeError(f"sizes {_sizes(d.symbols(), env)} divide by zero in {d} ({c.reason})") from None


def _shown(d, value: int) -> str:
    return str(value) if d.is_const else f"{d} = {value}"


def _sizes(symbols: set[str], env: dict[str, int]) -> str:
    return ", ".join(f"{s} = {env[s]}" for s in sorted(symbols) if s in env)


#: distinct argument keys a binder remembers (a call with a new key binds the checked way)
REMEMBERED_KEYS = 64


class Binder:
    """Binding for repeated calls of one function: the checked way, with quick paths.

    :meth:`bind` remembers the sizes it bound for each key of numpy arguments (their types,
    shapes and strides, and the caller's sizes): a later call with the same key checks the
    key alone, since binding reads nothing else.  A new key takes arrays of exactly the
    declared element types and ranks, for a signature whose every size is a name, by
    reading the sizes; anything else (and anything wrong) goes through
    :func:`bind_arguments`, which names what is wrong, before any work.
    :meth:`sizes_of` reads the sizes of arrays the library built to the signature itself.
    """

    def __init__(self, func: Func, constraints: Sequence[DimConstraint] = ()):
        self.func = func
        self.constraints = constraints
        spec = func.args
        #: (argument, axis, size name) per named size
        self.symbols = [
            (k, axis, d.symbol) for k, a in enumerate(spec) for axis, d in enumerate(a.type.shape) if d.is_symbol
        ]
        simple = not constraints and all(d.is_symbol for a in spec for d in a.type.shape)
        #: (element type, rank) per argument, when the quick path applies
        self.types = [(np.dtype(NUMPY_DTYPES[a.type.dtype]), a.type.rank) for a in spec] if simple else None
        #: key of a call's arguments -> the sizes they bound
        self.seen: dict[tuple, dict[str, int]] = {}
        #: every size name the arguments' shapes mention: a caller's size outside them (a decoder's
        #: cached length) binds nothing of theirs, so arguments seen before keep their key
        self.shape_names = {s for a in spec for d in a.type.shape for s in d.symbols()}
        #: the results' element types: what a call gives its outputs as
        self.result_dtypes = [np.dtype(NUMPY_DTYPES[v.type.dtype]) for v in func.results]

    def bind(self, args: Sequence[Any], sizes: dict[str, int] | None = None) -> tuple[list[Any], dict[str, int]]:
        """``bind_arguments(func, args, constraints, sizes)``, quickly for a key seen before."""
        key: tuple | None = tuple([(x.dtype, x.shape, x.strides) for x in args if type(x) is np.ndarray])
        if len(key) != len(args):  # not all numpy arrays: no key
            key = None
        elif not sizes:
            env = self.seen.get(key)
            if env is not None:
                return list(args), dict(env)
        else:
            own = not self.shape_names.isdisjoint(sizes)  # sizes that shapes must agree with
            if own:
                key = (*key, *sorted(sizes.items()))
            env = self.seen.get(key)
            if env is not None:
                env = dict(env) if own else {**env, **sizes}
                if own or self.fits(env):
                    return list(args), env
        arrays, env = self.bind_new(args, sizes)
        if key is not None and len(self.seen) < REMEMBERED_KEYS:
            self.seen[key] = dict(env)
        return arrays, env

    def bind_contiguous(self, arrays: Sequence[np.ndarray]) -> tuple[list[Any], dict[str, int]]:
        """:meth:`bind` for C-contiguous numpy ``arrays`` (a caller that made them so): keyed by
        element types and shapes alone, since their strides follow from those."""
        key = tuple([(x.dtype, x.shape) for x in arrays])
        env = self.seen.get(key)
        if env is not None:
            return list(arrays), dict(env)
        arrays, env = self.bind(arrays)
        if len(self.seen) < REMEMBERED_KEYS:
            self.seen[key] = dict(env)
        return arrays, env

    def fits(self, env: dict[str, int]) -> bool:
        """Whether ``env`` meets every constraint (a miss goes the checked way, which names it)."""
        try:
            for c in self.constraints:
                lhs, rhs = c.lhs.evaluate(env), c.rhs.evaluate(env)
                if (c.relation == "le" and lhs > rhs) or (c.relation == "eq" and lhs != rhs):
                    return False
        except (KeyError, ZeroDivisionError):
            return False
        return True

    def bind_new(self, args: Sequence[Any], sizes: dict[str, int] | None) -> tuple[list[Any], dict[str, int]]:
        types = self.types
        if types is not None and len(args) == len(types):
            if all(type(x) is np.ndarray and x.dtype == t and x.ndim == n for x, (t, n) in zip(args, types)):
                env = dict(sizes or {})
                for k, axis, name in self.symbols:
                    if env.setdefault(name, args[k].shape[axis]) != args[k].shape[axis]:
                        break
                else:
                    return list(args), env
        return bind_arguments(self.func, args, self.constraints, sizes)

    def sizes_of(self, arrays: Sequence[Any], sizes: dict[str, int]) -> dict[str, int]:
        """The sizes of ``arrays`` built to the signature (unchecked), with ``sizes`` the caller knows."""
        env = dict(sizes)
        for k, axis, name in self.symbols:
            env[name] = arrays[k].shape[axis]
        return env
