"""The tensor-core backward (``mma/backward_kernel.py``): f16/bf16 gradients of the example specs
against the float64 interpreter's, from the same arguments and saved residuals.

Under the simulator the warp instructions run ``mma/warp_sim.py``'s emulation; on a GPU
(``ATTNCOMP_TEST_GPU=1``) every example runs, on the PTX.  Sizes are not multiples of the blocks, so
skipped, masked and full tiles, padded query rows and padded keys all occur.
"""

import os

import numpy as np
import pytest

import attncomp as ac
from attncomp.testing import TOLERANCE, random_inputs, relative_error
from tests.cuda_sim.helpers import retyped
from tests.cuda_sim.test_sim_tensor_cores import ELEMENT, UNFUSED, attention_cases

ON_GPU = os.environ.get("NUMBA_ENABLE_CUDASIM") != "1"
#: one warp of keys per thread block, query rows 32 at a time
PIPELINE = "cse,softmax-fusion,flash-tiling{block_q=32,block_k=16},mask-elimination,canonicalize,cse,dce"
SIZES = {"B": 1, "H": 2, "KV": 1, "T": 37, "S": 35, "D": 16, "E": 16, "R": 33}

#: what the simulator runs: a site's gradient (ALiBi slopes), GQA (atomics into shared key/value
#: heads), soft-capping's derivative, an LSE cotangent with fully masked rows, sinks and a window,
#: query and key computed by the spec (RoPE and QK-norm)
IN_SIMULATOR = {
    ("alibi.causal_alibi", "bf16"),
    ("gqa.grouped_query_attention", "f16"),
    ("softcap.causal_softcap", "bf16"),
    ("lse.key_padding_with_lse", "f16"),
    ("sinks_window.sinks_window", "f16"),
    ("rope_qknorm.rope_qknorm", "f16"),
}


def backward_args(typed, fn, sizes: dict, seed: int) -> list:
    """The backward's arguments: the inputs, the residuals the cuda forward saved, and cotangents."""
    inputs = random_inputs(typed.ir.main, sizes, seed=seed)
    rng = np.random.default_rng(seed)
    # lengths, prefixes, document ids: inside the keys, so that tiles are partly masked
    inputs = [rng.integers(1, sizes["S"], x.shape).astype(x.dtype) if x.dtype.kind == "i" else x for x in inputs]
    saving = list(fn.forward_saving(*inputs))
    outs, saved = saving[:-2], saving[-2:]
    cotangents = [rng.standard_normal(o.shape).astype(o.dtype) for o in outs]
    return [*inputs, *saved, *cotangents]


def gradients(spec, dtype: str, pipeline: str = PIPELINE, sizes: dict | None = None, seed: int = 5):
    """(cuda function, its 16-bit gradients, the float64 interpreter's gradients from the same
    arguments and saved residuals): what the kernel adds, checked against exact arithmetic."""
    fn, _, got, want = gradients_and_args(spec, dtype, pipeline, sizes, seed)
    return fn, got, want


def gradients_and_args(spec, dtype: str, pipeline: str = PIPELINE, sizes: dict | None = None, seed: int = 5):
    """``gradients``, with the backward's arguments: (cuda function, arguments, its gradients, the
    float64 interpreter's)."""
    typed = retyped(spec, dtype)
    fn = ac.compile(typed, backend="cuda", pipeline=pipeline)
    args = backward_args(typed, fn, {**SIZES, **(sizes or {})}, seed)
    got = fn.backward(*args)
    want = ac.compile(typed, backend="interp", pipeline=pipeline).backward.compilation.run(args, exact=True)
    return fn, args, list(got), want


def check(got, want, dtype: str) -> None:
    for g, w in zip(got, want):
        if w is None:
            assert g is None
            continue
        assert np.abs(w).max() > 0
        assert relative_error(np.asarray(g, np.float64), np.asarray(w, np.float64)) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
@pytest.mark.parametrize("name,spec", attention_cases(), ids=[c[0] for c in attention_cases()])
def test_example_gradients_on_tensor_cores(name, spec, dtype):
    if not ON_GPU and (name, dtype) not in IN_SIMULATOR:
        pytest.skip("the simulator runs a few of the examples; a GPU runs them all")
    fn, got, want = gradients(spec, dtype)
    kernels = fn.backward.compilation.program.backward
    on_tensor_cores = [k.mma_plan(16, 16) is not None for k in kernels]
    # every fused attention's gradients (RoPE and QK-norm too: they compute in the input's type, a
    # Python float being weak); no key grid where nothing is fused
    assert all(on_tensor_cores) and bool(on_tensor_cores) != (name in UNFUSED)
    assert [f"mma_{dtype}(" in k.source(16, 16) for k in kernels] == on_tensor_cores
    assert got[0].dtype == np.dtype(ELEMENT[dtype])
    check(got, want, dtype)


def test_several_warps_and_parts_of_a_key_block():
    """D = 96, E = 80: 32 keys per thread block (two warps), so each IR key block of 64 is two
    thread blocks' parts, and two thread blocks share each part's keys, one for each half of the
    columns (dK and dQ 48, dV 40); query rows 16 at a time; each warp takes three of a half's six
    dQ fragments."""
    spec = dict(attention_cases())["causal.causal"]
    pipeline = "cse,softmax-fusion,flash-tiling{block_q=16,block_k=64},mask-elimination,canonicalize,cse,dce"
    fn, got, want = gradients(spec, "bf16", pipeline, sizes={"H": 1, "T": 21, "S": 70, "D": 96, "E": 80})
    plan = fn.backward.compilation.program.backward[0].mma_plan(96, 80)
    assert (plan.keys, plan.warps, plan.parts, plan.halves, plan.rows, plan.dq_fragments) == (32, 2, 2, 2, 16, 3)
    check(got, want, "bf16")


def test_gradients_through_vjp_follow_the_float32_spec():
    """End to end: the f16 spec's gradients (forward, saved residuals, tensor-core backward) against
    the float32 spec's at the same values."""
    spec = dict(attention_cases())["causal.causal"]
    typed = retyped(spec, "f16")
    inputs = random_inputs(typed.ir.main, SIZES, seed=6)
    d_out = np.random.default_rng(6).standard_normal((1, 2, 37, 16)).astype(np.float16)
    got = ac.compile(typed, backend="cuda", pipeline=PIPELINE).vjp(*inputs)[1](d_out)
    wide = [x.astype(np.float32) for x in inputs]
    want = ac.compile(spec, backend="interp", pipeline=PIPELINE).vjp(*wide)[1](d_out.astype(np.float32))
    check(got, want, "f16")


def test_vjp_of_bf16_device_memory_stays_on_the_device():
    """bf16 inputs and cotangent given as device patterns (``Bf16Bits``): the forward, the saved
    residuals and the gradients stay on the device, the gradients as ``Bf16Bits`` rounded there; they
    equal the host call's gradients (rounded on the host) and hold the bf16 tolerance against the
    float64 interpreter's gradients at the same values.  A cotangent of another shape is refused."""
    from numba import cuda

    from attncomp.backends.numba_cuda.host.arrays import Bf16Bits

    spec = dict(attention_cases())["alibi.causal_alibi"]
    typed = retyped(spec, "bf16")
    inputs = random_inputs(typed.ir.main, SIZES, seed=7)
    d_out = np.random.default_rng(7).standard_normal((1, 2, 37, 16)).astype(ELEMENT["bf16"])
    fn = ac.compile(typed, backend="cuda", pipeline=PIPELINE)
    bits = [Bf16Bits(cuda.to_device(x.view(np.uint16))) for x in [*inputs, d_out]]
    out, pullback = fn.vjp(*bits[:-1])
    assert isinstance(out, Bf16Bits)
    got = pullback(bits[-1])
    assert all(isinstance(g, Bf16Bits) for g in got)
    on_host = fn.vjp(*inputs)[1](d_out)
    for g, h in zip(got, on_host):
        np.testing.assert_array_equal(g.copy_to_host().view(np.uint16), h.view(np.uint16))
    wide = [x.astype(np.float32) for x in inputs]
    want = ac.compile(spec, backend="interp", pipeline=PIPELINE).vjp(*wide)[1](d_out.astype(np.float32))
    check([g.copy_to_host() for g in got], want, "bf16")
    with pytest.raises(ac.ShapeError, match=r"cotangent 0: expected shape \(1, 2, 37, 16\)"):
        pullback(bits[0][:, :, :5])


#: float32 on tf32 tensor cores (flash-tiling precision=tf32), as PIPELINE otherwise
TF32_PIPELINE = PIPELINE.replace("block_k=16}", "block_k=16,precision=tf32}")
#: what the simulator runs in float32 (3xTF32, the emulation's slowest, once): a site's gradient
#: in both precisions, GQA and soft-capping's derivative in one, a learned temperature's in one
TF32_IN_SIMULATOR = {
    ("alibi.causal_alibi", "exact"),
    ("alibi.causal_alibi", "tf32"),
    ("gqa.grouped_query_attention", "tf32"),
    ("softcap.causal_softcap", "tf32"),
    ("pass_specs.learned_temperature", "tf32"),
}


def temperature_terms(args: list) -> float:
    """The sum over every score of ``|dS (q . k)|``: the magnitudes of the terms that
    ``pass_specs.learned_temperature``'s temperature gradient sums, from the backward's arguments
    (q, k, v, t, the saved output and log-sum-exp, the output's cotangent), in float64."""
    q, k, v, t, out, lse, d_out = (np.asarray(a, np.float64) for a in args)
    qk = q @ k.T
    p = np.exp(qk * t[0] - lse[:, None])
    ds = p * (d_out @ v.T - (d_out * out).sum(-1, keepdims=True))
    return float(np.abs(ds * qk).sum())


#: gradients that sum terms cancelling far below their size, by (spec, which gradient): the sum of
#: their terms' magnitudes.  A sum's rounding error is relative to its terms, not to what they cancel
#: to: at the test's arguments a learned temperature (t = 2.47, peaked rows) has terms adding to some
#: 490 times its gradient, so tf32's rounding of q and k moves that gradient by about 10% (the kernel
#: agrees with a float64 model of its tf32 operands to 1e-4) and float32's by 1e-5 (the simulator's
#: exact exp2) to 3e-5 (ex2.approx's 2^-22 a term on a GPU); so such a gradient is held to
#: TERM_ERROR times its terms' magnitudes
CANCELLING = {("pass_specs.learned_temperature", 3): temperature_terms}
#: the relative error of one term: two operands rounded to tf32 (2^-11 each); in 3xTF32 float32
#: arithmetic, p from ex2.approx (2^-22) and a rounded product
TERM_ERROR = {"exact": 2.0**-21, "tf32": 2.0**-10}


@pytest.mark.parametrize("precision", ["exact", "tf32"])
@pytest.mark.parametrize("name,spec", attention_cases(), ids=[c[0] for c in attention_cases()])
def test_float32_gradients_on_tf32_tensor_cores(name, spec, precision):
    """float32 gradients from mma.sync.m16n8k8: precision=exact (the default) as 3xTF32 within
    float32's tolerance of the float64 interpreter's; precision=tf32 within f16's (tf32 keeps f16's
    11 bits: ALiBi's slope gradient, a sum of cancelling terms, sees 1.3e-2); a sum that cancels
    further (``CANCELLING``) within the precision's error of its terms; precision=ieee keeps the
    scalar kernel."""
    if not ON_GPU and (name, precision) not in TF32_IN_SIMULATOR:
        pytest.skip("the simulator runs a few of the examples; a GPU runs them all")
    pipeline = PIPELINE if precision == "exact" else TF32_PIPELINE
    fn, args, got, want = gradients_and_args(spec, "f32", pipeline)
    kernels = fn.backward.compilation.program.backward
    element = {"exact": "3xtf32", "tf32": "tf32"}[precision]
    plans = [k.mma_plan(16, 16) for k in kernels]
    assert all(plan is not None and plan.element == element for plan in plans)
    assert all("mma_tf32(" in k.source(16, 16) for k in kernels) and bool(kernels) != (name in UNFUSED)
    bound = TOLERANCE["f32"] if precision == "exact" else TOLERANCE["f16"]
    for n, (g, w) in enumerate(zip(got, want)):
        if w is None:
            continue
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        if (name, n) in CANCELLING:
            assert np.abs(g - w).max() < TERM_ERROR[precision] * CANCELLING[name, n](args)
        else:
            assert relative_error(g, w) < bound
    ieee = ac.compile(
        retyped(spec, "f32"), backend="cuda", pipeline=PIPELINE.replace("block_k=16}", "block_k=16,precision=ieee}")
    )
    assert all(k.mma_plan(16, 16) is None for k in ieee.backward.compilation.program.backward)
