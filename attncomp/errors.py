"""The exceptions users see."""

from __future__ import annotations


class AttncompError(Exception):
    """Base class of every attncomp error."""


class SpecError(AttncompError):
    """A spec cannot be traced; the message names the user's file and line."""


class ShapeError(AttncompError, ValueError):
    """Arguments of the wrong rank or size; the message names argument and dimension."""


class TypeCheckError(AttncompError):
    """An op's operands or attributes do not fit its type rule."""


class VerifyError(AttncompError):
    """The IR is malformed; the message reprints the ops around the fault."""


class IRParseError(AttncompError):
    """IR text cannot be read; the message carries line and column."""

    def __init__(self, message: str, line: int, column: int, source_line: str = ""):
        self.line = line
        self.column = column
        text = f"line {line}, column {column}: {message}"
        if source_line:
            text += f"\n  {source_line}\n  {' ' * (column - 1)}^"
        super().__init__(text)


class PipelineError(AttncompError):
    """A pipeline string names an unknown pass or option, or a pass failed."""


def with_location(message: str, where: str | None) -> str:
    """``message`` prefixed by ``where`` ("file:line") and followed by that source line, if known."""
    if not where:
        return message
    import linecache

    file, _, line = where.rpartition(":")
    source = linecache.getline(file, int(line)).strip() if line.isdigit() else ""
    return f"{where}: {message}" + (f"\n    {source}" if source else "")
