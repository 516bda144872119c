"""The deterministic backward (``flash-tiling{deterministic=true}``) under the simulator: gradients
against the interpreter's float64 ones, the same bits from run to run, and no floating-point atomics
(the scalar kernels of ``simt/deterministic_backward.py`` for float32; f16 and bf16 on tensor cores,
``tests/cuda_sim/test_sim_deterministic_tensor_cores.py``).

Blocks of 16 at sizes that are not multiples of them make skipped, masked and full tiles, padded
query rows and padded keys; GQA and a broadcast key batch axis make several query batch positions
share a key/value head; ALiBi's slopes (one index per head), a relative-bias table (an index per
element) and a temperature (no index) are the sites.  On a GPU (``ATTNCOMP_TEST_GPU=1``) the same
tests hold the hardware to the same bits.
"""

# Dimension names in annotations (ac.f32["T", "D"]) are not forward references.
# ruff: noqa: F821, UP037

from __future__ import annotations

import numpy as np
import pytest

import attncomp as ac
from attncomp.testing import TOLERANCE, relative_error
from tests.conftest import load_example
from tests.cuda_sim.helpers import check_gradients, normal
from tests.cuda_sim.test_sim_tensor_core_backward import backward_args
from tests.cuda_sim.test_sim_tensor_cores import ELEMENT, attention_cases

PIPELINE = (
    "cse,softmax-fusion,flash-tiling{block_q=16,block_k=16,deterministic=true},mask-elimination,canonicalize,cse,dce"
)


def _gradients(spec, args, cotangents, pipeline: str = PIPELINE, runs: int = 1):
    """(the cuda backward's kernels, the gradients of ``runs`` cuda runs, the interpreter's gradients)."""
    fn = ac.compile(spec, backend="cuda", pipeline=pipeline)
    got = [fn.vjp(*args)[1](*cotangents) for _ in range(runs)]
    want = ac.compile(spec, backend="interp", pipeline=pipeline).vjp(*args)[1](*cotangents)
    (kernels,) = fn.backward.compilation.program.backward
    assert kernels.deterministic
    return kernels, got, want


def _check(got, want, args, tolerance: float = 1e-5) -> None:
    check_gradients(got, want, args, tolerance)


def _same_bits(first, second) -> None:
    for a, b in zip(first, second):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.tobytes() == b.tobytes()


def test_causal_gradients_over_every_tile_class_are_the_same_bits_twice():
    spec = load_example("causal").causal
    rng = np.random.default_rng(0)
    args = [normal(rng, 1, 2, 40, 8), normal(rng, 1, 2, 37, 8), normal(rng, 1, 2, 37, 6)]
    interp = ac.compile(spec, backend="interp", pipeline=PIPELINE)
    assert set(np.unique(interp.block_map(*args))) == {0, 1, 2}
    kernels, (first, second), want = _gradients(spec, args, [normal(rng, 1, 2, 40, 6)], runs=2)
    _check(first, want, args)
    _same_bits(first, second)


def test_grouped_query_heads_add_into_their_key_value_head_in_order():
    """Two query heads per key/value head: each head's dK and dV rows of its own, added up in head order."""
    spec = load_example("gqa").grouped_query_attention
    rng = np.random.default_rng(2)
    args = [normal(rng, 1, 4, 33, 8), normal(rng, 1, 2, 30, 8), normal(rng, 1, 2, 30, 8)]
    kernels, (first, second), want = _gradients(spec, args, [normal(rng, 1, 4, 33, 8)], runs=2)
    _check(first, want, args)
    _same_bits(first, second)


@ac.spec
def broadcast_keys(q: ac.f32["B", "H", "T", "D"], k: ac.f32[1, "H", "S", "D"], v: ac.f32[1, "H", "S", "E"]):
    s = (q @ k.mT) * q.shape[-1] ** -0.5
    b, h, i, j = ac.index(s)
    return ac.softmax(ac.where(j <= i, s, -ac.inf), axis=-1) @ v


def test_a_key_batch_axis_broadcast_over_the_queries():
    """Keys and values of batch size 1 against three query batch entries: their gradients sum all three."""
    rng = np.random.default_rng(9)
    args = [normal(rng, 3, 1, 21, 4), normal(rng, 1, 1, 19, 4), normal(rng, 1, 1, 19, 4)]
    _, (got,), want = _gradients(broadcast_keys, args, [normal(rng, 3, 1, 21, 4)])
    _check(got, want, args)


def test_alibi_slopes_sum_per_thread_then_in_thread_order():
    spec = load_example("alibi").causal_alibi
    rng = np.random.default_rng(1)
    args = [normal(rng, 1, 2, 35, 8), normal(rng, 1, 2, 35, 8), normal(rng, 1, 2, 35, 8)]
    args.append(np.array([0.5, 0.25], dtype=np.float32))
    kernels, (got,), want = _gradients(spec, args, [normal(rng, 1, 2, 35, 8)])
    assert kernels.uniform == {0}  # slopes[h]: one index per query batch position
    _check(got, want, args)


def test_a_relative_bias_table_is_summed_element_by_element():
    """table[h, clip(i - j) + M]: an index per element, summed by thread 0 in element order."""
    spec = load_example("relative_bias").relative_bias
    rng = np.random.default_rng(4)
    args = [normal(rng, 1, 2, 30, 8), normal(rng, 1, 2, 27, 8), normal(rng, 1, 2, 27, 8)]
    args.append(normal(rng, 2, 33))
    kernels, (first, second), want = _gradients(spec, args, [normal(rng, 1, 2, 30, 8)], runs=2)
    assert kernels.uniform == set()
    _check(first, want, args)
    _same_bits(first, second)


def test_a_learnable_temperature_read_at_no_index():
    """A 0-d site and no batch axes."""
    from tests.passes.specs import learned_temperature

    rng = np.random.default_rng(7)
    args = [normal(rng, 21, 8), normal(rng, 19, 8), normal(rng, 19, 8), np.array([0.7], dtype=np.float32)]
    _, (got,), want = _gradients(learned_temperature, args, [normal(rng, 21, 8)])
    _check(got, want, args)


@ac.spec
def causal64(q: ac.f64["B", "H", "T", "D"], k: ac.f64["B", "H", "S", "D"], v: ac.f64["B", "H", "S", "E"]):
    s = (q @ k.mT) * q.shape[-1] ** -0.5
    b, h, i, j = ac.index(s)
    return ac.softmax(ac.where(j <= i, s, -ac.inf), axis=-1) @ v


def test_key_and_query_blocks_split_over_thread_blocks_in_float64():
    """Blocks of 128: each key block is two key-major thread blocks' parts, each query block two
    dQ thread blocks' parts."""
    pipeline = PIPELINE.replace("block_q=16,block_k=16", "block_q=128,block_k=128")
    rng = np.random.default_rng(6)
    f64 = np.float64
    args = [normal(rng, 1, 1, 150, 4, dtype=f64), normal(rng, 1, 1, 140, 4, dtype=f64)]
    args.append(normal(rng, 1, 1, 140, 3, dtype=f64))
    kernels, (got,), want = _gradients(causal64, args, [normal(rng, 1, 1, 150, 3, dtype=f64)], pipeline)
    assert (kernels.plan(4, 3).parts, kernels.dq_plan(4, 3).parts) == (2, 2)
    _check(got, want, args, tolerance=1e-10)


@pytest.mark.parametrize("name,dtype", [("alibi.causal_alibi", "bf16"), ("gqa.grouped_query_attention", "f16")])
def test_16_bit_gradients_run_tensor_cores_at_small_blocks(name, dtype):
    """f16 and bf16 at blocks of 32 x 16 and D = 16: the deterministic grid runs tensor cores
    (``mma/deterministic.py``, one warp of 16 keys, a dQ block of 32 rows); against the float64
    interpreter from the same saved residuals, the same bits twice."""
    from tests.cuda_sim.helpers import retyped

    typed = retyped(dict(attention_cases())[name], dtype)
    pipeline = PIPELINE.replace("block_q=16,block_k=16", "block_q=32,block_k=16")
    fn = ac.compile(typed, backend="cuda", pipeline=pipeline)
    sizes = {"B": 1, "H": 2, "KV": 1, "T": 37, "S": 35, "D": 16, "E": 16}
    args = backward_args(typed, fn, sizes, seed=5)
    got = [list(fn.backward(*args)) for _ in range(2)]
    want = ac.compile(typed, backend="interp", pipeline=pipeline).backward.compilation.run(args, exact=True)
    (kernels,) = fn.backward.compilation.program.backward
    assert (kernels.mma_plan(16, 16).keys, kernels.mma_plan(16, 16).rows) == (16, 32)
    assert "mma_" in kernels.source(16, 16) and "red_add_f32(" not in kernels.source(16, 16)
    assert got[0][0].dtype == np.dtype(ELEMENT[dtype])
    for g, w in zip(got[0], want):
        assert np.abs(w).max() > 0
        assert relative_error(np.asarray(g, np.float64), np.asarray(w, np.float64)) < TOLERANCE[dtype]
    _same_bits(*got)


@pytest.mark.parametrize(
    "example,name", [("gqa", "grouped_query_attention"), ("alibi", "causal_alibi"), ("relative_bias", "relative_bias")]
)
def test_deterministic_kernels_add_with_no_atomics(example, name):
    """The default kernels add dq, shared dk/dv and the sites with atomics; the deterministic ones store:
    on tf32 tensor cores (3xTF32) where every site is uniform, else on the scalar kernels."""
    spec = getattr(load_example(example), name)
    default = ac.compile(spec, backend="cuda", pipeline=PIPELINE.replace(",deterministic=true", ""))
    fn = ac.compile(spec, backend="cuda", pipeline=PIPELINE)
    (before,) = default.backward.compilation.program.backward
    (after,) = fn.backward.compilation.program.backward
    assert "cuda.atomic.add(out_dq" in before.source(16, 16)
    source = after.source(16, 16)
    assert "cuda.atomic" not in source and "red_add_f32(" not in source
    assert (after.mma_plan(16, 16) is None) == (name == "relative_bias")
    if name == "relative_bias":  # a site indexed per element: the scalar kernels
        for out, at in (("dq", "i0 + r0 + rr"), ("dk", "j0 + koff + c"), ("dv", "j0 + koff + c")):
            assert f"out_{out}[bi_0, bi_1, {at}, " in source
    else:  # each lane's places, from its row's first column
        assert all(f"{out}_lane[" in source for out in ("dq", "dk", "dv"))
    names = [k.name for k in fn.backward.compilation.program.kernels(16, 16) if "backward" in k.name]
    assert names == [f"attention_backward_kernel_0{s}[D=16,E=16]" for s in ("", "_dq", "_heads", "_sites")]
