"""A FlexAttention ``score_mod`` or ``mask_mod`` read as an expression, by calling it once on stand-ins.

FlexAttention's modifications are Python functions of tensors: ``score_mod(score, b, h, q_idx, kv_idx)``
and ``mask_mod(b, h, q_idx, kv_idx)``, written with torch's operators and functions and reading
tensors they capture (``bias[h, q_idx, kv_idx]``, ``doc[q_idx] == doc[kv_idx]``).  :func:`record`
calls one with a :class:`Probe` for each argument.  A probe answers every operator, every function
of :data:`TORCH_FUNCTIONS` (through torch's ``__torch_function__`` protocol, which torch also follows
for a real tensor indexed by probes) and the tensor methods of :data:`METHODS`, and gives back a new
probe holding the expression node of the result.  A node is a tuple, so an expression is hashable and
two calls of the same function with the same constants give equal expressions:

- ``("input", name)``: ``score``, ``b``, ``h``, ``q_idx`` or ``kv_idx``;
- ``("const", value, type name)``: a Python number or bool the function used (its type is part of the
  node: ``1``, ``1.0`` and ``True`` are three constants);
- ``("captured", n)``: the ``n``-th tensor the function read (its values are not in the node: the
  same function over another bias is the same expression);
- ``(op, *operands)``: an operation of :data:`OPS` on nodes.

Nothing is computed: the expression is what attncomp compiles (:mod:`attncomp.flex.specs`).  What a
probe cannot stand for (a Python ``if`` on it, a torch function not in the tables) raises
``NotImplementedError`` naming it.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch

from attncomp.torch.traced_ops import trace_constant

#: the operations an expression may hold, by name, and their number of operands
OPS = {
    "add": 2, "sub": 2, "mul": 2, "truediv": 2, "floordiv": 2, "mod": 2, "pow": 2,
    "lt": 2, "le": 2, "gt": 2, "ge": 2, "eq": 2, "ne": 2, "and": 2, "or": 2, "xor": 2,
    "neg": 1, "abs": 1, "invert": 1, "exp": 1, "log": 1, "tanh": 1, "sqrt": 1, "rsqrt": 1, "sin": 1, "cos": 1,
    "sigmoid": 1, "maximum": 2, "minimum": 2, "where": 3, "float": 1, "int": 1, "bool": 1, "index": None,
}  # fmt: skip

#: Python's operators on a probe, by the node they make (the reflected ones swap their operands)
OPERATORS = {
    "add": operator.add, "sub": operator.sub, "mul": operator.mul, "truediv": operator.truediv,
    "floordiv": operator.floordiv, "mod": operator.mod, "pow": operator.pow, "lt": operator.lt, "le": operator.le,
    "gt": operator.gt, "ge": operator.ge, "eq": operator.eq, "ne": operator.ne, "and": operator.and_,
    "or": operator.or_, "xor": operator.xor,
}  # fmt: skip

#: the nodes whose torch function and tensor method have the node's own name (``torch.exp``, ``Tensor.exp``)
SAME_NAMES = (
    "lt", "le", "gt", "ge", "eq", "ne", "neg", "abs", "exp", "log", "tanh", "sqrt", "rsqrt", "sin", "cos", "sigmoid",
    "maximum", "minimum", "where",
)  # fmt: skip
#: the nodes that torch names otherwise (beside the operators' methods, ``Tensor.__add__`` and ``__radd__``)
OTHER_NAMES = {
    "add": [torch.add, torch.Tensor.add],
    "sub": [torch.sub, torch.Tensor.sub],
    "mul": [torch.mul, torch.Tensor.mul],
    "truediv": [torch.div, torch.true_divide, torch.Tensor.div],
    "floordiv": [torch.floor_divide],
    "mod": [torch.remainder],
    "pow": [torch.pow, torch.Tensor.pow],
    "and": [torch.logical_and, torch.bitwise_and],
    "or": [torch.logical_or, torch.bitwise_or],
    "xor": [torch.logical_xor, torch.bitwise_xor],
    "neg": [torch.Tensor.__neg__],
    "abs": [torch.Tensor.__abs__],
    "invert": [torch.logical_not, torch.bitwise_not, torch.Tensor.__invert__],
    "index": [torch.Tensor.__getitem__],
    "clamp": [torch.clamp, torch.clip, torch.Tensor.clamp, torch.Tensor.clip],  # maximum, then minimum
}

#: torch's functions (and the tensor methods they are) a modification may call -> the node they make
TORCH_FUNCTIONS: dict[Any, str] = {}
for _name in SAME_NAMES:
    TORCH_FUNCTIONS.update(dict.fromkeys([getattr(torch, _name), getattr(torch.Tensor, _name)], _name))
for _name, _functions in OTHER_NAMES.items():
    TORCH_FUNCTIONS.update(dict.fromkeys(_functions, _name))
#: torch's reflected operators (``other - tensor`` as ``tensor.__rsub__(other)``): their operands swapped
REFLECTED: set[Any] = set()
for _name in OPERATORS:  # Tensor.__add__, Tensor.__radd__, ...
    TORCH_FUNCTIONS[getattr(torch.Tensor, f"__{_name}__")] = _name
    if hasattr(torch.Tensor, f"__r{_name}__"):
        TORCH_FUNCTIONS[getattr(torch.Tensor, f"__r{_name}__")] = _name
        REFLECTED.add(getattr(torch.Tensor, f"__r{_name}__"))

#: tensor methods called on a probe itself, by the node they make ("to" and the casts: by the type)
METHODS = {
    "abs": "abs", "exp": "exp", "log": "log", "tanh": "tanh", "sqrt": "sqrt", "rsqrt": "rsqrt", "sin": "sin",
    "cos": "cos", "sigmoid": "sigmoid", "neg": "neg", "logical_not": "invert", "logical_and": "and",
    "logical_or": "or", "maximum": "maximum", "minimum": "minimum",
}  # fmt: skip


class Probe:
    """A stand-in for a tensor inside a modification: holds the expression node of its value and the
    :class:`Recording` it belongs to; ``dtype`` is the type the value would have in FlexAttention
    (float32 scores, int32 positions, bool masks)."""

    def __init__(self, recording: Recording, node: tuple, dtype: torch.dtype):
        self.recording, self.node, self.dtype = recording, node, dtype

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Probe:
        recording = next(a.recording for a in _flat(args, kwargs) if isinstance(a, Probe))
        name = TORCH_FUNCTIONS.get(func)
        if name is None:
            raise NotImplementedError(
                f"flex_attention: the {recording.role} calls {_name_of(func)}, which attncomp cannot compile; it "
                f"compiles {', '.join(sorted(set(TORCH_FUNCTIONS.values())))} and the casts .to(), .float(), .int(), "
                ".long(), .bool()"
            )
        kwargs = dict(kwargs or {})
        if name == "clamp":
            x, low, high = (*args, None, None)[:3]
            return recording.clamp(x, kwargs.get("min", low), kwargs.get("max", high))
        if name == "index":
            tensor, key = args
            key = key if isinstance(key, tuple) else (key,)
            return recording.apply("index", tensor, *key)
        if name == "where" and "other" in kwargs:  # Tensor.where(condition, other)
            args = (*args, kwargs.pop("other"))
        if name == "where" and func is torch.Tensor.where:
            args = (args[1], args[0], args[2])  # x.where(condition, y) is where(condition, x, y)
        if kwargs:
            raise NotImplementedError(
                f"flex_attention: the {recording.role} calls {_name_of(func)} with {sorted(kwargs)}"
            )
        if func in REFLECTED:
            args = args[::-1]
        return recording.apply(name, *args)

    @property
    def device(self) -> torch.device:
        """The query's device (``torch.tensor(x, device=score.device)`` makes a captured constant)."""
        return self.recording.device

    #: a FlexAttention modification sees each value as a 0-d tensor
    shape = torch.Size([])
    ndim = 0

    def __getattr__(self, name: str) -> Callable[..., Probe]:
        if name.startswith("_"):  # what Python and libraries probe for (hasattr): no such attribute
            raise AttributeError(name)
        if name in METHODS:
            return lambda *others: self.recording.apply(METHODS[name], self, *others)
        if name in ("clamp", "clip"):
            return lambda min=None, max=None: self.recording.clamp(self, min, max)
        if name in ("new_ones", "new_zeros"):  # a constant (torch's and_masks and or_masks start from one)

            def constant(*size: Any, dtype: torch.dtype = self.dtype, **options: Any) -> Probe:
                one = name == "new_ones"
                value = one if dtype == torch.bool else float(one) if dtype.is_floating_point else int(one)
                return Probe(self.recording, const(value), dtype)

            return constant
        casts = {"float": torch.float32, "int": torch.int32, "long": torch.int64, "bool": torch.bool}
        if name in casts:
            return lambda: self.to(casts[name])
        raise NotImplementedError(
            f"flex_attention: the {self.recording.role} uses .{name}, which attncomp cannot compile"
        )

    def to(self, *args: Any, **kwargs: Any) -> Probe:
        """A cast: to a floating type, integers and booleans become float32 (a float stays as it is);
        to an integer type, booleans become 0 and 1; to bool, a comparison with 0."""
        dtype = kwargs.get("dtype", next((a for a in args if isinstance(a, torch.dtype)), None))
        if dtype is None:  # .to(device) and the like: the value itself
            return self
        return self.recording.cast(self, dtype)

    def __bool__(self) -> bool:
        raise NotImplementedError(
            f"flex_attention: the {self.recording.role} branches on a tensor's value (a Python if, and, or, not): "
            "write torch.where, &, | and ~ instead"
        )

    def __repr__(self) -> str:
        return f"<flex_attention probe {self.node}>"

    def __hash__(self) -> int:
        return id(self)

    def __neg__(self) -> Probe:
        return self.recording.apply("neg", self)

    def __pos__(self) -> Probe:
        return self

    def __abs__(self) -> Probe:
        return self.recording.apply("abs", self)

    def __invert__(self) -> Probe:
        return self.recording.apply("invert", self)

    def __getitem__(self, key: Any) -> Probe:
        raise NotImplementedError(f"flex_attention: the {self.recording.role} indexes a score or a position")


def _binary(name: str, reflected: bool) -> Callable[[Probe, Any], Probe]:
    def method(self: Probe, other: Any) -> Probe:
        return self.recording.apply(name, other, self) if reflected else self.recording.apply(name, self, other)

    return method


for _name in OPERATORS:
    setattr(Probe, f"__{_name}__", _binary(_name, False))
    if _name not in ("lt", "le", "gt", "ge", "eq", "ne"):
        setattr(Probe, f"__r{_name}__", _binary(_name, True))


class Recording:
    """One modification's call on probes: the tensors it read, in the order it first read them."""

    def __init__(self, role: str, device: torch.device | str = "cpu"):
        self.role, self.device = role, torch.device(device)
        self.captured: list[torch.Tensor] = []

    def input(self, name: str, dtype: torch.dtype) -> Probe:
        return Probe(self, ("input", name), dtype)

    def node(self, value: Any) -> tuple:
        """The node of an operand: a probe's own, a tensor's place among the captured ones, a constant."""
        if isinstance(value, Probe):
            return value.node
        if isinstance(value, torch.Tensor):
            for n, seen in enumerate(self.captured):
                if seen is value:
                    return ("captured", n)
            self.captured.append(value)
            return ("captured", len(self.captured) - 1)
        if isinstance(value, (bool, int, float)):
            return const(trace_constant(value))  # a number the trace holds as a symbol: its value, guarded
        raise NotImplementedError(
            f"flex_attention: the {self.role} uses a {type(value).__name__} ({value!r}) as an operand; it may use "
            "tensors, Python numbers and booleans"
        )

    def apply(self, name: str, *operands: Any) -> Probe:
        nodes = tuple(self.node(o) for o in operands)
        if OPS[name] is not None and len(nodes) != OPS[name]:
            raise NotImplementedError(f"flex_attention: the {self.role} calls {name} with {len(nodes)} operands")
        return Probe(self, (name, *nodes), _result_type(name, operands))

    def clamp(self, x: Probe, low: Any, high: Any) -> Probe:
        if low is not None:
            x = self.apply("maximum", x, low)
        return x if high is None else self.apply("minimum", x, high)

    def cast(self, x: Probe, dtype: torch.dtype) -> Probe:
        if dtype == torch.bool:
            return x if x.dtype == torch.bool else self.apply("ne", x, 0)
        if dtype.is_floating_point:
            return x if x.dtype.is_floating_point else Probe(self, ("float", x.node), torch.float32)
        if x.dtype.is_floating_point:
            raise NotImplementedError(f"flex_attention: the {self.role} casts a float to {dtype}")
        return x if x.dtype != torch.bool else Probe(self, ("int", x.node), torch.int32)


def const(value: bool | int | float) -> tuple:
    """The node of a Python constant."""
    return ("const", value, type(value).__name__)


def _result_type(name: str, operands: tuple) -> torch.dtype:
    if name in ("lt", "le", "gt", "ge", "eq", "ne", "invert") or name in ("and", "or", "xor"):
        return torch.bool
    if name == "index":
        return operands[0].dtype
    types = [o.dtype if isinstance(o, (Probe, torch.Tensor)) else _python_type(o) for o in operands[-2:]]
    if name in ("truediv", "exp", "log", "tanh", "sqrt", "rsqrt", "sin", "cos", "sigmoid"):
        return torch.float32
    return torch.float32 if any(t.is_floating_point for t in types) else torch.int32


def _python_type(value: Any) -> torch.dtype:
    return torch.bool if isinstance(value, bool) else torch.int32 if isinstance(value, int) else torch.float32


def _flat(args: tuple, kwargs: dict | None) -> list:
    flat = []
    for a in [*args, *(kwargs or {}).values()]:
        flat.extend(a if isinstance(a, (tuple, list)) else [a])
    return flat


def _name_of(func: Any) -> str:
    owner = "torch.Tensor." if getattr(func, "__objclass__", None) is not None else "torch."
    return owner + getattr(func, "__name__", repr(func))


def record(
    score_mod: Callable | None, mask_mod: Callable | None, device: torch.device | str = "cpu"
) -> tuple[tuple | None, tuple | None, list]:
    """The expressions ``score_mod(score, b, h, q_idx, kv_idx)`` and ``mask_mod(b, h, q_idx, kv_idx)``
    compute (None for a modification not given) and the tensors they read, numbered across both;
    ``device`` is the query's."""
    recording = Recording("score_mod", device)
    positions = [recording.input(name, torch.int32) for name in ("b", "h", "q_idx", "kv_idx")]
    score = None
    if score_mod is not None:
        score = recording.node(score_mod(recording.input("score", torch.float32), *positions))
    mask = None
    if mask_mod is not None:
        recording.role = "mask_mod"
        mask = recording.node(mask_mod(*positions))
    return score, mask, recording.captured
