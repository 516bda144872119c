"""Symbolic dimensions: integer polynomials over named sizes.

A dimension is a sum of terms ``coeff * atom * atom ...`` where an atom is a
size name (``"T"``) or an exact floor division of a dimension by a positive
integer (``D//2``).  The representation is canonical, so two dimensions are
equal exactly when their printed forms are equal:

    T            a named size
    64           a fixed size
    (D//2)       floor division by a constant
    (H*D)        a product
    (D-D//2)     the other half of an odd-sized split
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property

Monomial = tuple["Atom", ...]


@dataclass(frozen=True, order=True)
class FloorDiv:
    """The atom ``num // den`` (``den`` positive at run time)."""

    num: Dim
    den: Dim

    def __str__(self) -> str:
        return f"{self.num}//{self.den}"


Atom = str | FloorDiv


def _atom_key(atom: Atom) -> tuple[int, str]:
    return (0, atom) if isinstance(atom, str) else (1, str(atom))


def _monomial_key(mono: Monomial) -> tuple:
    return (not mono, len(mono), [_atom_key(a) for a in mono])


@dataclass(frozen=True)
class Dim:
    """An immutable canonical polynomial; build with :func:`dim`."""

    terms: tuple[tuple[Monomial, int], ...]

    # construction -------------------------------------------------------
    @staticmethod
    def _make(coeffs: dict[Monomial, int]) -> Dim:
        items = [(m, c) for m, c in coeffs.items() if c != 0]
        items.sort(key=lambda mc: _monomial_key(mc[0]))
        return Dim(tuple(items))

    @staticmethod
    def const(value: int) -> Dim:
        return Dim._make({(): int(value)})

    @staticmethod
    def sym(name: str) -> Dim:
        return Dim._make({(name,): 1})

    # queries ------------------------------------------------------------
    @cached_property
    def is_const(self) -> bool:
        return all(not m for m, _ in self.terms)

    @property
    def value(self) -> int:
        """The constant value; only for constant dimensions."""
        if not self.is_const:
            raise ValueError(f"dimension {self} is not a constant")
        return self.terms[0][1] if self.terms else 0

    @property
    def is_symbol(self) -> bool:
        return len(self.terms) == 1 and self.terms[0][1] == 1 and _is_name(self.terms[0][0])

    @property
    def symbol(self) -> str:
        assert self.is_symbol
        return self.terms[0][0][0]

    def symbols(self) -> set[str]:
        names: set[str] = set()
        for mono, _ in self.terms:
            for atom in mono:
                if isinstance(atom, str):
                    names.add(atom)
                else:
                    names |= atom.num.symbols() | atom.den.symbols()
        return names

    def evaluate(self, env: dict[str, int]) -> int:
        total = 0
        for mono, coeff in self.terms:
            prod = coeff
            for atom in mono:
                if isinstance(atom, str):
                    prod *= env[atom]
                else:
                    prod *= atom.num.evaluate(env) // atom.den.evaluate(env)
            total += prod
        return total

    # arithmetic ---------------------------------------------------------
    def __add__(self, other: DimLike) -> Dim:
        other = dim(other)
        coeffs = dict(self.terms)
        for mono, c in other.terms:
            coeffs[mono] = coeffs.get(mono, 0) + c
        return Dim._make(coeffs)

    __radd__ = __add__

    def __neg__(self) -> Dim:
        return Dim._make({m: -c for m, c in self.terms})

    def __sub__(self, other: DimLike) -> Dim:
        return self + (-dim(other))

    def __rsub__(self, other: DimLike) -> Dim:
        return dim(other) - self

    def __mul__(self, other: DimLike) -> Dim:
        other = dim(other)
        coeffs: dict[Monomial, int] = {}
        for m1, c1 in self.terms:
            for m2, c2 in other.terms:
                mono = tuple(sorted(m1 + m2, key=_atom_key))
                coeffs[mono] = coeffs.get(mono, 0) + c1 * c2
        return Dim._make(coeffs)

    __rmul__ = __mul__

    def __floordiv__(self, other: DimLike) -> Dim:
        other = dim(other)
        if other.is_const:
            den = other.value
            if den <= 0:
                raise ValueError(f"cannot divide a dimension by {den}")
            if den == 1:
                return self
            if all(c % den == 0 for _, c in self.terms):
                return Dim._make({m: c // den for m, c in self.terms})
            if self.is_const:
                return Dim.const(self.value // den)
        quotient = self._exact_divide(other)
        if quotient is not None:
            return quotient
        return Dim._make({(FloorDiv(self, other),): 1})

    def _exact_divide(self, other: Dim) -> Dim | None:
        """``self / other`` when ``other`` is one term dividing every term."""
        if len(other.terms) != 1:
            return None
        ((omono, ocoeff),) = other.terms
        coeffs: dict[Monomial, int] = {}
        for mono, c in self.terms:
            rest = list(mono)
            for atom in omono:
                if atom not in rest:
                    return None
                rest.remove(atom)
            if c % ocoeff:
                return None
            coeffs[tuple(rest)] = c // ocoeff
        return Dim._make(coeffs)

    # printing -----------------------------------------------------------
    def __str__(self) -> str:
        return self._text

    @cached_property
    def _text(self) -> str:
        """The printed form, computed once: a dimension is immutable, and the printer, the verifier
        and the type checks ask a dimension of a pipeline for its text some 200,000 times."""
        if not self.terms:
            return "0"
        parts = []
        for k, (mono, coeff) in enumerate(self.terms):
            mag = abs(coeff)
            # A leading "-" would bind tighter than "//": -(D//2) must not print as -D//2.
            alone = len(mono) == 1 and mag == 1 and not (k == 0 and coeff < 0)
            factors = [str(a) if isinstance(a, str) or alone else f"({a})" for a in mono]
            if mag != 1 or not factors:
                factors.insert(0, str(mag))
            body = "*".join(factors)
            if k == 0:
                parts.append(("-" if coeff < 0 else "") + body)
            else:
                parts.append(("-" if coeff < 0 else "+") + body)
        out = "".join(parts)
        simple = self.is_symbol or (self.is_const and self.value >= 0)
        return out if simple else f"({out})"

    def __repr__(self) -> str:
        return f"Dim({self})"

    def __lt__(self, other: Dim) -> bool:
        return str(self) < str(other)


DimLike = Dim | int | str


def _is_name(mono: Monomial) -> bool:
    return len(mono) == 1 and isinstance(mono[0], str)


def dim(value: DimLike) -> Dim:
    """Coerce an int, a size name or a Dim to a Dim."""
    if isinstance(value, Dim):
        return value
    if isinstance(value, bool):
        raise TypeError("a dimension cannot be a bool")
    if isinstance(value, int):
        return Dim.const(value)
    if isinstance(value, str):
        return parse_dim(value)
    raise TypeError(f"cannot use {value!r} as a dimension")


# parsing ------------------------------------------------------------------
_TOKEN = re.compile(r"\s*(?:(\d+)|([A-Za-z_][A-Za-z0-9_]*)|(//|[-+*()]))")


def parse_dim(text: str) -> Dim:
    """Parse the printed form of a dimension (the inverse of ``str``)."""
    tokens = tokenize_dim(text)
    parser = DimParser(tokens)
    result = parser.expr()
    if parser.pos != len(tokens):
        raise ValueError(f"unexpected {tokens[parser.pos]!r} in dimension {text!r}")
    return result


def tokenize_dim(text: str) -> list[str]:
    tokens, pos = [], 0
    text = text.strip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m or m.end() == pos:
            raise ValueError(f"bad character {text[pos]!r} in dimension {text!r}")
        tokens.append(m.group(1) or m.group(2) or m.group(3))
        pos = m.end()
    return tokens


class DimParser:
    """Recursive descent over dimension tokens: ``expr := term (+|- term)*``."""

    def __init__(self, tokens: list[str], pos: int = 0):
        self.tokens = tokens
        self.pos = pos

    def peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self) -> str:
        tok = self.peek()
        if tok is None:
            raise ValueError("dimension ends too early")
        self.pos += 1
        return tok

    def expr(self) -> Dim:
        value = self.term()
        while self.peek() in ("+", "-"):
            op = self.take()
            rhs = self.term()
            value = value + rhs if op == "+" else value - rhs
        return value

    def term(self) -> Dim:
        value = self.factor()
        while self.peek() in ("*", "//"):
            op = self.take()
            rhs = self.factor()
            value = value * rhs if op == "*" else value // rhs
        return value

    def factor(self) -> Dim:
        tok = self.take()
        if tok == "-":
            return -self.factor()
        if tok == "(":
            inner = self.expr()
            if self.take() != ")":
                raise ValueError("expected ')' in dimension")
            return inner
        if tok.isdigit():
            return Dim.const(int(tok))
        if tok[0].isalpha() or tok[0] == "_":
            return Dim.sym(tok)
        raise ValueError(f"unexpected {tok!r} in dimension")
