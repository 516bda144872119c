"""save-residuals: make the forward also return what its backward reads.

Every fused ``ac.attention`` of the function is made to compute its
log-sum-exp (``with_lse = true``), and its output and LSE are appended to
the function's results, in program order; the function attribute
``residuals`` counts them.  These are the ``saved`` arguments of the
function ``autodiff`` derives from the same IR: O(T) beside the output,
never a T x S array.  ``fn.vjp`` runs the forward compiled with this pass.
"""

from __future__ import annotations

from dataclasses import dataclass

from attncomp.ir.core import Module, Value
from attncomp.ir.ops.attention import add_lse
from attncomp.passes.autodiff import attention_ops
from attncomp.passes.base import Pass, register_pass


@register_pass
@dataclass
class SaveResiduals(Pass):
    name = "save-residuals"
    summary = "return each fused attention's output and log-sum-exp for the backward"

    def run(self, module: Module, remarks: list[str]) -> None:
        func = module.main
        saved: list[Value] = []
        for attn in attention_ops(func):
            add_lse(attn)
            saved += attn.results[:2]
        func.return_op.operands = func.return_op.operands + saved
        func.attrs["residuals"] = len(saved)
