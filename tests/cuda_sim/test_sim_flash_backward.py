"""The asynchronous-copy tensor-core backward (``mma/flash_backward.py``) against the float64 interpreter.

Keys, values, query and output-gradient rows reach shared memory by ``cp.async`` and every operand
by ``ldmatrix`` (``.trans`` where a product sums along a tile's rows), in the simulator through the
emulation that lands a copy only at its wait and counts shared accesses by bank.  Sizes are not
multiples of the blocks: skipped, masked and full tiles, rows and keys past the end all occur.  A
call whose rows are strided runs the staged kernel (``mma/backward_kernel.py``) instead.
"""

import numpy as np
import pytest

from attncomp.backends.numba_cuda.mma.flash_backward_plan import FlashBackwardPlan
from tests.cuda_sim.test_sim_flash import _strided, no_conflicts
from tests.cuda_sim.test_sim_tensor_core_backward import attention_cases, check, gradients_and_args

#: the default blocks: 64 keys a thread block (four warps) up to D = 64, 32 past it (two warps for
#: each 16: two thread blocks a key block); query rows 32 at a time
PIPELINE = "cse,softmax-fusion,flash-tiling{block_q=64,block_k=64},mask-elimination,canonicalize,cse,dce"
CASES = dict(attention_cases())


def flash_gradients(name: str, d: int, dtype: str = "f16", sizes: dict | None = None):
    """(the backward's program, its gradients, the interpreter's) of an example at D = E = ``d``."""
    sizes = {"B": 1, "H": 2, "KV": 1, "T": 70, "S": 75, "D": d, "E": d, "R": 33, **(sizes or {})}
    fn, _, got, want = gradients_and_args(CASES[name], dtype, PIPELINE, sizes)
    return fn.backward.compilation.program, got, want


@pytest.mark.parametrize(
    "name,dtype,d",
    [
        ("causal.causal", "f16", 64),
        ("causal.causal", "bf16", 32),
        ("gqa.grouped_query_attention", "f16", 32),  # query heads share the keys' rows
        ("alibi.causal_alibi", "bf16", 32),  # the slopes' gradient, summed in a register
        # two warps a key group, each half the rows' scores and half the dK and dV columns
        ("gqa.grouped_query_attention", "bf16", 128),
        ("alibi.causal_alibi", "f16", 128),
    ],
)
def test_gradients_with_async_copies(name, dtype, d, banks):
    program, got, want = flash_gradients(name, d, dtype)
    (kernels,) = program.backward
    plan = kernels.mma_plan(d, d)
    assert isinstance(plan, FlashBackwardPlan) and plan.choice.async_copies
    shape = (64, 32, 1, 4, 1) if d <= 64 else (32, 32, 2, 4, 2)
    assert (plan.keys, plan.rows, plan.split, plan.warps, plan.parts) == shape
    source = kernels.source(d, d)
    assert "cp_async16(" in source and "ldmatrix_x4_trans(" in source and "red_add_f32(" in source
    if dtype == "bf16":  # kept 16-bit: the kernel copies the patterns; delta's reduction widens them
        assert plan.choice.storage == "bits"
        (delta,) = [k for k in program.graph_kernels if k.name.endswith("_reduce")]
        assert "widen_bf16(" in delta.source and delta.signature.count("uint16") == 2
    check(got, want, dtype)
    no_conflicts(banks)


def test_strided_rows_run_the_staged_kernel():
    """Key and value given as views whose rows are not one after another: the staged kernel of the
    same spec, the same gradients."""
    from attncomp.backends.numba_cuda.host.arrays import copy_to_host

    sizes = {"B": 1, "H": 1, "KV": 1, "T": 21, "S": 30, "D": 32, "E": 32, "R": 33}
    fn, args, got, want = gradients_and_args(CASES["causal.causal"], "f16", PIPELINE, sizes)
    (kernels,) = fn.backward.compilation.program.backward
    assert not kernels.mma_plan(32, 32, dense=False).choice.async_copies
    strided = [_strided(x) if x.ndim == 4 and x.shape[-2] == sizes["S"] else x for x in args]
    again = [copy_to_host(g) for g in fn.backward(*strided)]
    check(again, want, "f16")
    for a, b in zip(again, got):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("d,kernel", [(48, "mma m16n8k16 bf16, storage"), (8, "fma, storage")])
def test_other_head_dims_read_the_same_bf16_patterns(d, kernel):
    """Head dims the asynchronous-copy kernel does not take run the staged tensor-core kernel (D = 48:
    its copies do not share evenly) or the scalar one (D = 8), from the same 16-bit patterns."""
    program, got, want = flash_gradients("causal.causal", d, "bf16", {"H": 1, "T": 40, "S": 45})
    (kernels,) = program.backward
    choice = kernels.choice_for(d, d)
    assert not choice.async_copies and choice.describe().startswith(f"backward, {kernel} bf16 bits")
    check(got, want, "bf16")
