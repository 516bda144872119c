"""What a pass is: a named module-to-module rewrite with typed options."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar

from attncomp.ir.core import Module

PASSES: dict[str, type[Pass]] = {}


@dataclass
class Pass:
    """Subclasses set ``name``, declare options as dataclass fields, and implement ``run``.

    ``run`` rewrites the module in place (the manager hands it a private
    copy) and may append human-readable remarks about what it did not do.
    """

    name: ClassVar[str]
    summary: ClassVar[str] = ""

    def run(self, module: Module, remarks: list[str]) -> None:
        raise NotImplementedError

    @classmethod
    def option_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    def describe(self) -> str:
        opts = ",".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self))
        return self.name + (f"{{{opts}}}" if opts else "")


def register_pass(cls: type[Pass]) -> type[Pass]:
    PASSES[cls.name] = cls
    return cls
