"""float32 attention on tensor cores: the tf32 product against its fragment layout (``mma/atoms.py``), the
tf32 rounding and split, and float32 example specs as 3xTF32 (the default, float32-accurate) and as
one TF32 product (``precision = "tf32"``) against the float64 interpreter.

Under the simulator the warp instructions run ``mma/warp_sim.py``'s emulation; on a GPU
(``ATTNCOMP_TEST_GPU=1``) the PTX (``attncomp/backends/numba_cuda/warp.py``), both placed by the
table of ``attncomp/backends/numba_cuda/mma/atoms.py``.
"""

import numpy as np
import pytest
from numba import cuda

from attncomp.backends.numba_cuda.mma.atoms import M16N8K8_TF32
from attncomp.backends.numba_cuda.warp import bits_f32, f32_bits, mma_tf32, tf32_rest, tf32_round
from attncomp.testing import TOLERANCE, random_inputs, worst_error
from tests.cuda_sim.helpers import as_list, build_cuda, host
from tests.cuda_sim.test_sim_tensor_cores import (
    ON_GPU,
    SIZES,
    accumulators,
    attention_cases,
    places,
    store_accumulators,
)

#: two warps of query rows, one key tile of 16
PIPELINE = "cse,softmax-fusion,flash-tiling{{block_q=32,block_k=16{}}},mask-elimination,canonicalize,cse,dce"
#: one TF32 product rounds each input to 11 significant bits: relative errors near 2^-11 per term
TF32_TOLERANCE = 4e-3


def tf32_reference(x: np.ndarray) -> np.ndarray:
    """float32 rounded to 10 fraction bits, to nearest, ties away from zero (``cvt.rna.tf32.f32``)."""
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x1000) & 0xFFFFE000).astype(np.uint32).view(np.float32)


@cuda.jit
def split_kernel(x, big, rest, back):
    i = cuda.grid(1)
    if i < x.size:
        b = tf32_round(x[i])
        big[i] = bits_f32(b)
        rest[i] = bits_f32(tf32_rest(x[i], b))
        back[i] = bits_f32(f32_bits(x[i]))


def test_tf32_round_and_split():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(64) * 10.0 ** rng.integers(-6, 6, 64)).astype(np.float32)
    x[:2] = [1.0 + 2.0**-11, -(1.0 + 2.0**-11)]  # ties: away from zero
    big, rest, back = (np.zeros(64, np.float32) for _ in range(3))
    split_kernel[1, 64](x, big, rest, back)
    np.testing.assert_array_equal(back, x)
    np.testing.assert_array_equal(big, tf32_reference(x))
    assert big[0] == 1.0 + 2.0**-10 and big[1] == -(1.0 + 2.0**-10)
    np.testing.assert_array_equal(rest, tf32_reference(x - big))
    # big + rest carries 22 significant bits
    assert np.all(np.abs((big.astype(np.float64) + rest) - x) <= np.abs(x) * 2.0**-21)


@cuda.jit(device=True)
def rounded(m, at, lane, r):
    """Register ``r`` of a lane: the element at its place (``at``: the table), rounded to tf32."""
    return tf32_round(m[at[lane, r, 0, 0], at[lane, r, 0, 1]])


@cuda.jit
def fragment_kernel(a, b, c, a_at, b_at, c_at, out):
    """One warp: A (16 x 8), B (8 x 8) and C (16 x 8) placed by the tf32 atom's table, one product,
    D back to its places."""
    lane = cuda.threadIdx.x
    a0, a1 = rounded(a, a_at, lane, 0), rounded(a, a_at, lane, 1)
    a2, a3 = rounded(a, a_at, lane, 2), rounded(a, a_at, lane, 3)
    b0, b1 = rounded(b, b_at, lane, 0), rounded(b, b_at, lane, 1)
    c0, c1, c2, c3 = accumulators(c, c_at, lane)
    d0, d1, d2, d3 = mma_tf32(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)
    store_accumulators(out, c_at, lane, d0, d1, d2, d3)


def test_tf32_mma_fragments_follow_the_documented_layout():
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((16, 8)).astype(np.float32), rng.standard_normal((8, 8)).astype(np.float32)
    c = rng.standard_normal((16, 8)).astype(np.float32)
    out = np.zeros((16, 8), np.float32)
    tables = places(M16N8K8_TF32.a), places(M16N8K8_TF32.b), places(M16N8K8_TF32.c)
    fragment_kernel[1, 32](a, b, c, *tables, out)
    exact = tf32_reference(a).astype(np.float64) @ tf32_reference(b).astype(np.float64) + c
    np.testing.assert_allclose(out, exact, rtol=1e-5, atol=1e-5)


#: what the simulator runs in float32 (every CUDA thread is a Python thread)
IN_SIMULATOR = {"alibi.causal_alibi", "gqa.grouped_query_attention", "lse.key_padding_with_lse"}


def run_f32(spec, precision: str, seed: int = 3):
    option = "" if precision == "exact" else f",precision={precision}"
    fn, impl = build_cuda(spec, PIPELINE.format(option))
    inputs = random_inputs(spec.ir.main, SIZES, seed=seed)
    rng = np.random.default_rng(seed)
    inputs = [rng.integers(1, SIZES["S"], x.shape).astype(x.dtype) if x.dtype.kind == "i" else x for x in inputs]
    got = [host(g) for g in as_list(impl.call(fn.func, inputs, fn.constraints))]
    want = fn.compilation.run(inputs, exact=True)
    return impl, got, want


@pytest.mark.parametrize("precision", ["exact", "tf32"])
@pytest.mark.parametrize("name,spec", attention_cases(), ids=[c[0] for c in attention_cases()])
def test_float32_example_on_tensor_cores(name, spec, precision):
    if not ON_GPU and name not in IN_SIMULATOR:
        pytest.skip("the simulator runs a few of the examples; a GPU runs them all")
    impl, got, want = run_f32(spec, precision)
    element = {"exact": "3xtf32", "tf32": "tf32"}[precision]
    for kernels in impl.attention:
        assert kernels.element == element
        assert kernels.mma_plan(16, 16).tf32
        source = kernels.source(16, 16)
        assert source.count("mma_tf32(") == (3 if precision == "exact" else 1) * (16 // 8) * (16 // 8) * 2
    assert got[0].dtype == np.float32
    assert worst_error(got, want) < (TOLERANCE["f32"] if precision == "exact" else TF32_TOLERANCE)


def test_ieee_precision_keeps_the_scalar_kernels():
    spec = dict(attention_cases())["alibi.causal_alibi"]
    fn, impl = build_cuda(spec, PIPELINE.format(",precision=ieee"))
    assert 'precision = "ieee"' in fn.ir("final")
    assert impl.attention[0].element is None and impl.attention[0].mma_plan(16, 16) is None
    assert "mma_" not in impl.attention[0].source(16, 16)
