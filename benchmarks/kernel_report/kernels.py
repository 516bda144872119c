"""The kernels reported: a spec of ``benchmarks/specs.py`` in one float type at one head dim, forward
or backward, built as a call with C-contiguous arrays launches it (``KernelInfo``: its signature and
launch bounds)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import attncomp as ac
from attncomp.passes import default_pipeline
from benchmarks import specs


@dataclass(frozen=True)
class Case:
    spec: str  # a spec's name in ``benchmarks/specs.py``
    dtype: str  # "bf16", "f16", "f32"
    head_dim: int  # D = E
    backward: bool = False
    #: a decode step's kernel: one query row a head, ``group`` query heads a key/value head (their
    #: rows packed into tensor-core tiles where the grid allows); 0: a call of whole blocks of rows
    group: int = 0

    @property
    def label(self) -> str:
        kind = "bwd" if self.backward else f"decode G={self.group}" if self.group else "fwd"
        return f"{self.spec} {self.dtype} D={self.head_dim} {kind}"


#: what ``python -m benchmarks.kernel_report`` reports without options
DEFAULT = [
    Case("causal_any", "bf16", 64),
    Case("causal_any", "bf16", 128),
    Case("dense_any", "f16", 128),
    Case("causal_any", "f32", 64),  # 3xTF32, the default precision
    Case("gqa_decode_any", "bf16", 128, group=4),  # GQA 32/8
    Case("causal_any", "bf16", 64, backward=True),
    Case("causal_any", "bf16", 128, backward=True),
]


@dataclass(frozen=True)
class Built:
    case: Case
    kernel: Any  # ``attncomp.backends.numba_cuda.KernelInfo``
    products: str  # the tensor-core products' type ("bf16", "3xtf32", ...), or "scalar"
    threads: int  # the block size it is launched with

    @property
    def label(self) -> str:
        """The case, and "1sp" for the kernel of a launch without key splits (one whose thread blocks
        fill the GPU, as a long prefill's)."""
        choice = self.kernel.choice
        one_split = choice is not None and not choice.key_splits
        return f"{self.case.label} 1sp" if one_split else self.case.label


def build(case: Case, pipeline: str | None = None) -> list[Built]:
    """The attention kernels of one case (the forward's, or the backward's)."""
    from attncomp.backends import numba_cuda

    spec = getattr(specs, case.spec, None)
    if not isinstance(spec, ac.Spec):
        raise ValueError(f"no spec {case.spec!r} in benchmarks/specs.py")
    # the cuda backend's default pipeline unless given one (``passes.default_pipeline("cuda")``)
    fn = ac.compile(spec, backend="interp", pipeline=pipeline or default_pipeline("cuda"))
    if not fn.generic and case.dtype != "f32":
        raise ValueError(f"{case.spec} declares its types; use a generic spec (ac.floating) for {case.dtype}")
    fn = fn.for_dtype(case.dtype)
    if case.backward:
        impl = numba_cuda.build(fn.backward.module)
        groups, prefix = impl.backward, "attention_backward_kernel_"
    else:
        impl = numba_cuda.build(fn.module)
        groups, prefix = impl.attention, "attention_kernel_"
    d = case.head_dim
    plans = [group.mma_plan(d, d) for group in groups]
    products = ",".join(sorted({plan.element for plan in plans if plan is not None})) or "scalar"
    if case.group:
        kernels = impl.decode_kernels(d, d, rows=1, group=case.group)
        plans = [group.mma_plan(d, d, 16, packed=True) for group in groups]
        products = ",".join(sorted({plan.element for plan in plans if plan is not None})) or "scalar"
    else:
        kernels = [kernel for kernel in impl.kernels(d, d) if kernel.name.startswith(prefix)]
    if not case.backward and not case.group:
        kernels += [one_split(group, d) for group in groups if not group.choice_for(d, d, splits=False).key_splits]
    from attncomp.backends.numba_cuda.host.launches import SIMULATED

    if SIMULATED:  # the CUDA simulator's kernels have no launch bounds, no PTX
        raise ValueError("the kernel report compiles PTX: unset NUMBA_ENABLE_CUDASIM")
    # a deterministic backward's ordered sums (``_heads``, ``_sites``: grid-stride loops with no
    # launch bounds) are left out
    found = [Built(case, k, products, k.launch_bounds) for k in kernels if isinstance(k.launch_bounds, int)]
    if not found:
        raise ValueError(f"{case.label}: no attention kernel")
    return found


def one_split(group: Any, d: int) -> Any:
    """The forward kernel of a launch whose thread blocks fill the GPU: no key splits, no merge
    (``KernelChoice.key_splits``), as ``impl.kernels`` lists the other."""
    from attncomp.backends.numba_cuda.program import group_kernel

    pitched = {"pitched": True} if group.views else {}  # arguments read through transposed views
    return group_kernel(group, f"{group.name}[D={d},E={d},one split]", d, d, splits=False, **pitched)
