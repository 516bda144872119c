"""How an op kind is declared: its type rule and its reference meaning.

Each op kind is an :class:`OpDef` registered by name.  ``infer`` computes the
result types from the operand types and attributes (or checks the declared
result types of ops whose type cannot be inferred, such as ``ac.reshape``);
``evaluate`` gives the op's meaning on float64/int64 numpy arrays, which is
what the reference interpreter runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from attncomp.errors import TypeCheckError
from attncomp.ir.dims import Dim, dim
from attncomp.ir.types import TensorType

OP_DEFS: dict[str, OpDef] = {}


@dataclass(frozen=True)
class DimConstraint:
    """Two dimensions a type rule needed equal but could not prove equal."""

    lhs: Dim
    rhs: Dim
    reason: str
    #: "eq": lhs == rhs; "le": lhs <= rhs
    relation: str = "eq"


@dataclass
class Checker:
    """Unifies dimensions for type rules and collects run-time constraints.

    Two distinct names (``T`` and ``S``) or a name and a fixed size never
    unify: one name is one size.  When a compound dimension is involved
    (``KV*(H//KV)`` against ``H``) equality cannot be decided until the sizes
    are known, so it becomes a constraint checked when arguments are bound.
    """

    constraints: list[DimConstraint] = field(default_factory=list)

    def unify(self, a: Dim, b: Dim, what: str) -> Dim:
        if a == b:
            return a
        simple_a = a.is_symbol or a.is_const
        simple_b = b.is_symbol or b.is_const
        if simple_a and simple_b:
            raise TypeCheckError(f"{what}: dimension {a} does not match {b}")
        self.constraints.append(DimConstraint(a, b, what))
        return a if simple_a else b

    def require_le(self, a: Dim, b: Dim, what: str) -> None:
        """``a <= b``: checked now when decidable, else when sizes are bound."""
        gap = b - a
        if gap.is_const:
            if gap.value < 0:
                raise TypeCheckError(f"{what}: {a} exceeds {b}")
            return
        self.constraints.append(DimConstraint(a, b, what, "le"))

    def broadcast(self, shapes: list[tuple[Dim, ...]], what: str) -> tuple[Dim, ...]:
        rank = max((len(s) for s in shapes), default=0)
        out = []
        for axis in range(rank):
            dims = [s[len(s) - rank + axis] for s in shapes if len(s) - rank + axis >= 0]
            non_one = [d for d in dims if not (d.is_const and d.value == 1)]
            if not non_one:
                out.append(dim(1))
                continue
            result = non_one[0]
            for other in non_one[1:]:
                try:
                    result = self.unify(result, other, what)
                except TypeCheckError:
                    shown = " and ".join(f"({', '.join(map(str, s))})" for s in shapes)
                    raise TypeCheckError(
                        f"{what}: shapes {shown} cannot broadcast: {result} against {other} on axis {axis - rank}"
                    ) from None
            out.append(result)
        return tuple(out)


@dataclass
class EvalContext:
    """What ops need at evaluation time besides their operands."""

    env: dict[str, int]
    run_block: Callable[..., list[np.ndarray]] | None = None
    #: observes tile positions and classes (for block_map); None when not wanted
    recorder: Any = None


class OpDef:
    """Base of op kinds.  Subclasses set ``name`` and override the rules."""

    name: ClassVar[str]
    #: attribute name -> short description, for docs and the verifier
    attributes: ClassVar[dict[str, str]] = {}
    #: result types are written in the IR and checked, not inferred
    declared_result: ClassVar[bool] = False
    #: number of operands, or None for variadic
    num_operands: ClassVar[int | None] = None
    terminator: ClassVar[bool] = False
    #: evaluating it may raise (a check): kept by dce though nothing uses a result
    effect: ClassVar[bool] = False

    def infer(
        self,
        operands: list[TensorType],
        attrs: dict[str, Any],
        declared: list[TensorType] | None,
        checker: Checker,
    ) -> list[TensorType]:
        raise NotImplementedError

    def evaluate(self, op: Any, args: list[np.ndarray], ctx: EvalContext) -> list[np.ndarray]:
        raise NotImplementedError

    def verify_regions(self, op: Any) -> None:
        """Check the op's regions (argument and yielded types); none by default."""
        if op.regions:
            raise TypeCheckError(f"{self.name}: takes no regions")


def register(cls: type[OpDef]) -> type[OpDef]:
    OP_DEFS[cls.name] = cls()
    return cls


def require_attr(attrs: dict[str, Any], key: str, kind: type | tuple[type, ...], what: str) -> Any:
    if key not in attrs:
        raise TypeCheckError(f"{what}: missing attribute '{key}'")
    value = attrs[key]
    if not isinstance(value, kind) or isinstance(value, bool) and bool not in _as_tuple(kind):
        raise TypeCheckError(f"{what}: attribute '{key}' has the wrong kind: {value!r}")
    return value


def _as_tuple(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def normalize_axis(axis: int, rank: int, what: str) -> int:
    if not -rank <= axis < rank:
        raise TypeCheckError(f"{what}: axis {axis} is out of range for rank {rank}")
    return axis % rank


def single_declared(declared: list[TensorType] | None, what: str) -> TensorType:
    if not declared or len(declared) != 1:
        raise TypeCheckError(f"{what}: needs exactly one declared result type")
    return declared[0]


def float64_like(dtype: str) -> type:
    """The numpy type the interpreter computes a dtype in."""
    if dtype == "i1":
        return np.bool_
    return np.int64 if dtype.startswith("i") else np.float64
