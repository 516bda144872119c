"""Every op kind of the IR, registered by name in ``OP_DEFS``."""

from attncomp.ir.ops import attention, compute, elementwise, gradient, random, shape, structural, tile
from attncomp.ir.ops.base import OP_DEFS, Checker, DimConstraint, EvalContext, OpDef

__all__ = [
    "OP_DEFS",
    "Checker",
    "DimConstraint",
    "EvalContext",
    "OpDef",
    "attention",
    "compute",
    "elementwise",
    "gradient",
    "random",
    "shape",
    "structural",
    "tile",
]
