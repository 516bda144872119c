"""Reads the IR text back: the inverse of :mod:`attncomp.ir.printer`."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from attncomp.errors import IRParseError
from attncomp.ir.core import Block, Func, Module, Op, Value
from attncomp.ir.dims import Dim, DimParser
from attncomp.ir.types import DTYPES, TensorType

_TOKEN = re.compile(
    r"""(?P<ws>\s+)
      | (?P<value>%[A-Za-z0-9_.$]+)
      | (?P<symbol>@[A-Za-z0-9_.$]+)
      | (?P<block>\^[A-Za-z0-9_]+)
      | (?P<number>\d+(?:\.\d*)?(?:[eE][+-]?\d+)?)
      | (?P<string>"(?:[^"\\]|\\.)*")
      | (?P<ident>[A-Za-z_][A-Za-z0-9_.]*)
      | (?P<punct>->|//|[=,:(){}\[\]<>*+-])
    """,
    re.VERBOSE,
)


@dataclass
class Token:
    kind: str
    text: str
    line: int
    column: int


def tokenize(text: str) -> list[Token]:
    tokens: list[Token] = []
    pos, line, line_start = 0, 1, 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m:
            raise IRParseError(f"unexpected character {text[pos]!r}", line, pos - line_start + 1, _line(text, line))
        kind = m.lastgroup or ""
        if kind != "ws":
            tokens.append(Token(kind, m.group(), line, pos - line_start + 1))
        end = m.end()
        newlines = text.count("\n", pos, end)  # in whitespace, or a string's text
        if newlines:
            line += newlines
            line_start = text.rfind("\n", pos, end) + 1
        pos = end
    tokens.append(Token("eof", "", line, pos - line_start + 1))
    return tokens


def _line(text: str, number: int) -> str:
    lines = text.splitlines()
    return lines[number - 1] if 0 < number <= len(lines) else ""


class Parser:
    def __init__(self, text: str):
        self.text = text
        self.tokens = tokenize(text)
        self.pos = 0
        self.scopes: list[dict[str, Value]] = []

    # token helpers ------------------------------------------------------
    @property
    def tok(self) -> Token:
        return self.tokens[self.pos]

    def error(self, message: str, tok: Token | None = None) -> IRParseError:
        tok = tok or self.tok
        return IRParseError(message, tok.line, tok.column, _line(self.text, tok.line))

    def at(self, text: str) -> bool:
        return self.tok.text == text and self.tok.kind in ("punct", "ident")

    def take(self, kind: str | None = None, text: str | None = None) -> Token:
        tok = self.tok
        if (kind and tok.kind != kind) or (text and tok.text != text):
            wanted = repr(text) if text else kind
            found = repr(tok.text) if tok.text else "the end of the text"
            raise self.error(f"expected {wanted}, found {found}")
        self.pos += 1
        return tok

    def expect_more(self, what: str) -> None:
        if self.tok.kind == "eof":
            raise self.error(f"expected '}}' to close {what}, found the end of the text")

    def accept(self, text: str) -> bool:
        if self.at(text):
            self.pos += 1
            return True
        return False

    # values -------------------------------------------------------------
    def define(self, tok: Token, value: Value) -> None:
        name = tok.text[1:]
        if any(name in scope for scope in self.scopes):
            raise self.error(f"%{name} is defined twice", tok)
        value.name = name
        self.scopes[-1][name] = value

    def use(self) -> Value:
        tok = self.take("value")
        for scope in reversed(self.scopes):
            if tok.text[1:] in scope:
                return scope[tok.text[1:]]
        raise self.error(f"use of undefined value {tok.text}", tok)

    # types --------------------------------------------------------------
    def parse_type(self) -> TensorType:
        self.take("ident", "tensor")
        self.take("punct", "<")
        parts: list[list[Token]] = [[]]
        depth = 0
        while not (depth == 0 and self.at(">")):
            tok = self.tok
            if tok.kind == "eof":
                raise self.error("unterminated tensor type")
            if tok.kind == "ident" and tok.text == "x" and depth == 0:
                parts.append([])
            else:
                depth += tok.text == "("
                depth -= tok.text == ")"
                parts[-1].append(tok)
            self.pos += 1
        self.take("punct", ">")
        dtype_toks = parts.pop()
        if len(dtype_toks) != 1 or dtype_toks[0].text not in DTYPES:
            bad = dtype_toks[0] if dtype_toks else self.tok
            raise self.error(f"expected an element type ({', '.join(DTYPES)})", bad)
        return TensorType(tuple(self.dim_of(p) for p in parts), dtype_toks[0].text)

    def dim_of(self, toks: list[Token]) -> Dim:
        if not toks:
            raise self.error("empty dimension")
        parser = DimParser([t.text for t in toks])
        try:
            result = parser.expr()
        except ValueError as exc:
            raise self.error(str(exc), toks[0]) from None
        if parser.pos != len(toks):
            raise self.error(f"unexpected {toks[parser.pos].text!r} in dimension", toks[parser.pos])
        return result

    def parse_types(self) -> list[TensorType]:
        types = [self.parse_type()]
        while self.at(",") and self.tokens[self.pos + 1].text == "tensor":
            self.take()
            types.append(self.parse_type())
        return types

    # attributes ---------------------------------------------------------
    def parse_attrs(self) -> dict[str, Any]:
        self.take("punct", "{")
        attrs: dict[str, Any] = {}
        while not self.at("}"):
            key = self.take("ident")
            if key.text in attrs:
                raise self.error(f"attribute '{key.text}' is given twice", key)
            self.take("punct", "=")
            attrs[key.text] = self.parse_attr_value()
            if not self.accept(","):
                break
        self.take("punct", "}")
        return attrs

    def parse_attr_value(self) -> Any:
        tok = self.tok
        if tok.text == "-" and self.tokens[self.pos + 1].kind in ("number", "ident"):
            self.take()
            value = self.parse_attr_value()
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise self.error("'-' must be followed by a number", tok)
            return -value
        if tok.kind == "number":
            self.take()
            is_float = any(c in tok.text for c in ".eE")
            return float(tok.text) if is_float else int(tok.text)
        if tok.kind == "string":
            self.take()
            return bytes(tok.text[1:-1], "utf-8").decode("unicode_escape")
        if tok.text == "[":
            self.take()
            items = []
            while not self.at("]"):
                items.append(self.parse_attr_value())
                if not self.accept(","):
                    break
            self.take("punct", "]")
            return items
        if tok.kind == "ident":
            self.take()
            keywords = {"true": True, "false": False, "inf": float("inf"), "nan": float("nan")}
            return keywords[tok.text] if tok.text in keywords else Dim.sym(tok.text)
        if tok.text == "(":
            start, depth = self.pos, 0
            while True:
                depth += self.tok.text == "("
                depth -= self.tok.text == ")"
                if self.tok.kind == "eof":
                    raise self.error("unbalanced parentheses in a dimension", tok)
                self.pos += 1
                if depth == 0:
                    break
            return self.dim_of(self.tokens[start : self.pos])
        raise self.error(f"expected an attribute value, found {tok.text!r}")

    # ops ----------------------------------------------------------------
    def parse_block_args(self, block: Block) -> None:
        self.take("punct", "(")
        while not self.at(")"):
            tok = self.take("value")
            self.take("punct", ":")
            self.define(tok, block.add_arg(self.parse_type()))
            if not self.accept(","):
                break
        self.take("punct", ")")

    def parse_op(self) -> Op:
        result_toks: list[Token] = []
        if self.tok.kind == "value":
            result_toks.append(self.take("value"))
            while self.accept(","):
                result_toks.append(self.take("value"))
            self.take("punct", "=")
        name_tok = self.take("ident")
        operands: list[Value] = []
        if self.tok.kind == "value":
            operands.append(self.use())
            while self.accept(","):
                operands.append(self.use())
        attrs = self.parse_attrs() if self.at("{") else {}
        types = []
        if self.accept(":"):
            types = self.parse_types()
        if len(types) != len(result_toks):
            raise self.error(
                f"{name_tok.text} names {len(result_toks)} results but gives {len(types)} types",
                name_tok,
            )
        regions = []
        if self.at("(") and self.tokens[self.pos + 1].text == "{":
            self.take()
            while True:
                self.take("punct", "{")
                regions.append(self.parse_region())
                self.take("punct", "}")
                if not self.accept(","):
                    break
            self.take("punct", ")")
        op = Op.create(name_tok.text, operands, types, attrs, regions)
        for tok, value in zip(result_toks, op.results):
            self.define(tok, value)
        self.op_tokens[op] = name_tok
        return op

    def parse_region(self) -> Block:
        block = Block()
        self.scopes.append({})
        self.take("block")
        self.parse_block_args(block)
        self.take("punct", ":")
        while not self.at("}"):
            self.expect_more("a region")
            block.ops.append(self.parse_op())
        self.scopes.pop()
        return block

    def parse_func(self) -> Func:
        self.take("ident", "ac.func")
        name = self.take("symbol").text[1:]
        body = Block()
        self.scopes.append({})
        self.parse_block_args(body)
        arrow = self.take("punct", "->")
        if self.accept("("):
            declared = self.parse_types()
            self.take("punct", ")")
        else:
            declared = [self.parse_type()]
        attrs = {}
        if self.accept("attributes"):
            attrs = self.parse_attrs()
        self.take("punct", "{")
        while not self.at("}"):
            self.expect_more(f"@{name}")
            body.ops.append(self.parse_op())
        self.take("punct", "}")
        self.scopes.pop()
        if not body.ops or body.ops[-1].name != "ac.return":
            raise self.error(f"@{name} must end with ac.return", arrow)
        returned = [v.type for v in body.ops[-1].operands]
        if returned != declared:
            shown = ", ".join(map(str, returned))
            raise self.error(f"@{name} declares results that ac.return does not give ({shown})", arrow)
        return Func(name, body, attrs)

    def parse_module(self) -> Module:
        self.op_tokens: dict[Op, Token] = {}
        funcs = []
        while self.tok.kind != "eof":
            funcs.append(self.parse_func())
        if not funcs:
            raise self.error("expected 'ac.func'")
        return Module(funcs)


def parse_ir(text: str, verify: bool = True) -> Module:
    """Parse IR text into a module and (by default) verify it."""
    parser = Parser(text)
    module = parser.parse_module()
    if verify:
        from attncomp.ir.verifier import verify_module

        verify_module(module)
    return module
