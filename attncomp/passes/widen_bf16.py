"""widen-bf16: every bf16 value computed as float32, the IR the cuda backend generates kernels from.

Numba-CUDA arrays have no bfloat16 element (and its simulator no bf16 type).  float32 holds every
bf16 value, and the IR's promotions agree (bf16 with f32, and f16 with bf16, are f32), so the
widened module computes what the spec says, in float32: only the final rounding of results declared
bf16 is left, and the backend does it where results come back (see ``backends/numba_cuda/``).

The cuda backend runs this pass after any pipeline (``passes.manager.BACKEND_PIPELINES``): the call
keeps the pipeline's signature (bf16 arguments and results), the kernels are generated from this
stage.  What the backend decides by the declared types (query, key and value kept as 16-bit patterns
for tensor-core attention, bf16 outputs written as patterns) it reads from the pipeline's module.
"""

from __future__ import annotations

from dataclasses import dataclass

from attncomp.ir.core import Module
from attncomp.ir.retype import retype
from attncomp.passes.base import Pass, register_pass


@register_pass
@dataclass
class WidenBf16(Pass):
    name = "widen-bf16"
    summary = "compute bf16 values as float32 (the cuda backend's kernels)"

    def run(self, module: Module, remarks: list[str]) -> None:
        retype(module, "bf16", "f32")
