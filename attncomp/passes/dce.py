"""dce: drop ops whose results nothing uses (liveness from the networkx use-def graph)."""

from __future__ import annotations

from dataclasses import dataclass

from attncomp.ir.core import Module
from attncomp.ir.graph import remove_dead_ops
from attncomp.passes.base import Pass, register_pass


@register_pass
@dataclass
class DeadCodeElimination(Pass):
    name = "dce"
    summary = "remove ops whose results are unused"

    def run(self, module: Module, remarks: list[str]) -> None:
        for func in module.funcs:
            remove_dead_ops(func.body)
