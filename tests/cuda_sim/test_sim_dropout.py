"""Attention dropout on the cuda backend against the float64 interpreter: the weight region (the
probabilities kept where ``ac.random(seed, b, h, i, j) >= rate``, scaled by ``1 / (1 - rate)``) in the
forward after the rows' sums, and in the backward on dP and on the probabilities dV is made of.

bf16 runs the tensor-core kernels (asynchronous copies, ldmatrix), float32 with ``precision=ieee``
the scalar ones.  Sizes are not multiples of the blocks: skipped, masked and full tiles.
"""

# Dimension names in annotations (ac.f32["T", "D"]) are not forward references.
# ruff: noqa: F821

import numpy as np
import pytest

import attncomp as ac
from attncomp.backends.numba_cuda.mma.flash_backward_plan import FlashBackwardPlan
from attncomp.testing import TOLERANCE, random_inputs, relative_error
from tests.cuda_sim.helpers import host, retyped
from tests.cuda_sim.test_sim_tensor_core_backward import check, gradients_and_args

#: blocks of 32: two query and two key blocks (a skipped, a full and two masked tiles); D = 64 (whole
#: 128-byte rows): the asynchronous-copy kernels, forward and backward, for bf16
PIPELINE = "cse,softmax-fusion,flash-tiling{{block_q=32,block_k=32{}}},mask-elimination,canonicalize,cse,dce"
SIZES = {"B": 1, "H": 2, "KV": 1, "T": 40, "S": 45, "D": 64, "E": 64}


@ac.spec
def causal_dropout(
    q: ac.f32["B", "H", "T", "D"],
    k: ac.f32["B", "KV", "S", "D"],
    v: ac.f32["B", "KV", "S", "E"],
    seed: ac.i64,
    *,
    rate: float = 0.3,
):
    n_rep = q.shape[1] // k.shape[1]
    s = (q @ ac.repeat_kv(k, n_rep).mT) * q.shape[-1] ** -0.5
    b, h, i, j = ac.index(s)
    p = ac.softmax(ac.where(j <= i, s, -ac.inf), axis=-1)
    return ac.dropout(p, rate, seed) @ ac.repeat_kv(v, n_rep)


@pytest.mark.parametrize("dtype,precision", [("bf16", ""), ("f32", ",precision=ieee")], ids=["bf16-mma", "f32-scalar"])
def test_dropout_forward_and_gradients_match_the_interpreter(dtype, precision):
    pipeline = PIPELINE.format(precision)
    typed = retyped(causal_dropout, dtype)
    fn = ac.compile(typed, backend="cuda", pipeline=pipeline)
    inputs = random_inputs(typed.ir.main, SIZES, seed=3)
    got = host(fn(*inputs))
    want = ac.compile(typed, backend="interp", pipeline=pipeline)(*inputs)
    no_dropout = ac.compile(typed, backend="interp", pipeline=pipeline, rate=0.0)(*inputs)
    assert relative_error(np.asarray(got, np.float64), np.asarray(want, np.float64)) < TOLERANCE[dtype]
    assert relative_error(np.asarray(no_dropout, np.float64), np.asarray(want, np.float64)) > 0.1  # it drops
    kernels = fn.compilation.program.attention[0]
    assert "random_step(" in kernels.source(64, 64)
    assert kernels.last_choice.async_copies == (dtype == "bf16")
    fn, _, grads, want_grads = gradients_and_args(causal_dropout, dtype, pipeline, SIZES)
    (backward,) = fn.backward.compilation.program.backward
    assert (dtype == "bf16") == isinstance(backward.mma_plan(64, 64), FlashBackwardPlan)
    check(grads, want_grads, dtype)
