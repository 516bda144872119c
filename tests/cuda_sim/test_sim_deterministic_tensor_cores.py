"""The deterministic backward on tensor cores (``mma/deterministic.py``) against the float64 interpreter.

A deterministic grid of f16 or bf16 operands runs the asynchronous-copy kernels without atomics: a
key-major kernel storing dK and dV and summing the sites in a fixed order, a query-major dQ kernel
keeping dQ in registers.  Sizes are not multiples of the blocks (skipped, masked and full tiles; rows
and keys past the end); GQA makes query heads share a key/value head; ALiBi's slopes are a uniform
site.  Two runs give the same bits.  A site indexed per element (a relative-bias table), strided rows
and head dims the plan does not take run the scalar deterministic kernels, from the same 16-bit
patterns.
"""

import numpy as np
import pytest

from attncomp.backends.numba_cuda.mma.flash_backward_plan import FlashBackwardPlan
from tests.cuda_sim.test_sim_flash import _strided, no_conflicts
from tests.cuda_sim.test_sim_tensor_core_backward import attention_cases, check, gradients_and_args

#: blocks of 32: at the sizes below, two query blocks and two key blocks (skipped, masked and full
#: tiles), each key block one thread block of 32 keys, each query block one dQ thread block of 32 rows
PIPELINE = (
    "cse,softmax-fusion,flash-tiling{block_q=32,block_k=32,deterministic=true},mask-elimination,canonicalize,cse,dce"
)
CASES = dict(attention_cases())


def deterministic_gradients(name: str, d: int, dtype: str, sizes: dict | None = None, pipeline: str = PIPELINE):
    """(the cuda function, its arguments, its gradients, the interpreter's) of an example at D = E = ``d``."""
    sizes = {"B": 1, "H": 2, "KV": 1, "T": 40, "S": 45, "D": d, "E": d, "R": 33, **(sizes or {})}
    return gradients_and_args(CASES[name], dtype, pipeline, sizes)


def same_bits(first, second) -> None:
    for a, b in zip(first, second):
        assert (a is None) == (b is None)
        if a is not None:
            assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


@pytest.mark.parametrize(
    "name,dtype,d",
    [
        ("causal.causal", "f16", 64),
        ("gqa.grouped_query_attention", "bf16", 32),  # each query head's dK, dV rows, summed in head order
        ("alibi.causal_alibi", "bf16", 64),  # the slopes: lane sums, then thread order, then block order
        ("alibi.causal_alibi", "f16", 128),  # two warps a key group
    ],
)
def test_gradients_on_tensor_cores_are_the_same_bits_twice(name, dtype, d, banks):
    fn, args, got, want = deterministic_gradients(name, d, dtype)
    (kernels,) = fn.backward.compilation.program.backward
    plan = kernels.mma_plan(d, d)
    assert kernels.deterministic and isinstance(plan, FlashBackwardPlan)
    source = kernels.source(d, d)
    assert "mma_" in source and "ldmatrix_x4_trans(" in source
    assert "red_add_f32(" not in source and "cuda.atomic" not in source
    names = [k.name for k in fn.backward.compilation.program.kernels(d, d) if "backward" in k.name]
    assert names == [f"attention_backward_kernel_0{s}[D={d},E={d}]" for s in ("", "_dq", "_heads", "_sites")]
    check(got, want, dtype)
    no_conflicts(banks)
    same_bits(got, fn.backward(*args))


def test_the_dq_pass_takes_64_rows_up_to_d64():
    """Query blocks of 64 at D = 64: the dQ pass's thread block takes all 64 rows (twice the products
    for each chunk of keys it copies), the key-major kernel 32 at a time."""
    pipeline = PIPELINE.replace("block_q=32", "block_q=64")
    fn, args, got, want = deterministic_gradients("alibi.causal_alibi", 64, "bf16", {"T": 70}, pipeline)
    (kernels,) = fn.backward.compilation.program.backward
    plan = kernels.mma_plan(64, 64)
    assert (plan.rows, kernels.dq_pass_plan(plan).rows) == (32, 64)
    check(got, want, "bf16")


def test_a_site_indexed_per_element_runs_the_scalar_kernels():
    """A relative-bias table (an index per element): thread 0 sums it element by element, on the
    scalar kernels, from the bf16 patterns."""
    fn, args, got, want = deterministic_gradients("relative_bias.relative_bias", 32, "bf16", {"T": 40, "S": 37})
    (kernels,) = fn.backward.compilation.program.backward
    assert kernels.mma_plan(32, 32) is None
    assert kernels.choice_for(32, 32).describe().startswith("backward, fma, storage bf16 bits")
    check(got, want, "bf16")
    same_bits(got, fn.backward(*args))


def test_strided_rows_run_the_scalar_kernels():
    from attncomp.backends.numba_cuda.host.arrays import copy_to_host

    sizes = {"H": 1, "T": 21, "S": 30}
    fn, args, got, want = deterministic_gradients("causal.causal", 32, "f16", sizes)
    (kernels,) = fn.backward.compilation.program.backward
    assert kernels.mma_plan(32, 32, dense=False) is None
    strided = [_strided(x) if x.ndim == 4 and x.shape[-2] == 30 else x for x in args]
    again = [copy_to_host(g) for g in fn.backward(*strided)]
    check(again, want, "f16")


@pytest.mark.parametrize("precision,tolerance", [("exact", "f32"), ("tf32", "f16")])
def test_float32_gradients_on_tf32_tensor_cores(precision, tolerance):
    """float32 on the staged design's ``m16n8k8``: 3xTF32 (float32's tolerance) or one tf32 product
    (f16's: tf32 keeps its 11 bits); the dQ pass's tiles keep dS beside the query rows."""
    from attncomp.backends.numba_cuda.mma.backward_plan import DqPassPlan

    pipeline = PIPELINE.replace("deterministic=true", f"deterministic=true,precision={precision}")
    sizes = {"B": 1, "H": 2, "KV": 1, "T": 40, "S": 45, "D": 16, "E": 16}
    fn, args, got, want = gradients_and_args(CASES["alibi.causal_alibi"], "f32", pipeline, sizes)
    (kernels,) = fn.backward.compilation.program.backward
    choice = kernels.choice_for(16, 16)
    assert choice.deterministic and not choice.async_copies
    assert choice.products == {"exact": "3xtf32"}.get(precision, "tf32")
    plan = kernels.dq_pass_plan(kernels.mma_plan(16, 16))
    assert isinstance(plan, DqPassPlan) and plan.layout["ds"] >= plan.layout["o"] + plan.rows * plan.v_pitch
    assert "red_add_f32(" not in kernels.source(16, 16) and "cuda.atomic" not in kernels.source(16, 16)
    check(got, want, tolerance)
    same_bits(got, fn.backward(*args))
