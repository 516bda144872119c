"""Gradients on the CUDA backend, under the simulator, against the interpreter's float64 gradients.

The backward kernel (one thread block per batch position and key block, gradients summed with
atomics) runs with blocks of 16 at sizes that are not multiples of them, so that skipped, masked
and full tiles, padded query rows and padded keys all occur; the unfused pipeline runs the
backward graph op by op (``ac.scatter_add`` among them).
"""

# Dimension names in annotations (ac.f64["T", "D"]) are not forward references.
# ruff: noqa: F821, UP037

from __future__ import annotations

import numpy as np
import pytest

import attncomp as ac
from attncomp.testing import relative_error
from tests.conftest import load_example
from tests.cuda_sim.helpers import check_gradients, normal

#: blocks of 16: the test sizes below make several tiles of every class
PIPELINE = "cse,softmax-fusion,flash-tiling{block_q=16,block_k=16},mask-elimination,canonicalize,cse,dce"


def _gradients(spec, args, cotangents, pipeline: str = PIPELINE):
    """(cuda gradients, interp gradients) of ``spec`` at ``args`` for these cotangents."""
    got = ac.compile(spec, backend="cuda", pipeline=pipeline).vjp(*args)[1](*cotangents)
    want = ac.compile(spec, backend="interp", pipeline=pipeline).vjp(*args)[1](*cotangents)
    return got, want


def _check(got, want, args, tolerance: float = 1e-4) -> None:
    check_gradients(got, want, args, tolerance)


def test_causal_gradients_over_every_tile_class():
    spec = load_example("causal").causal
    rng = np.random.default_rng(0)
    args = [normal(rng, 1, 2, 40, 8), normal(rng, 1, 2, 37, 8), normal(rng, 1, 2, 37, 6)]
    d_out = normal(rng, 1, 2, 40, 6)
    interp = ac.compile(spec, backend="interp", pipeline=PIPELINE)
    # the backward classifies the same tiles by the same mask
    assert set(np.unique(interp.block_map(*args))) == {0, 1, 2}
    out, lse = interp.forward_saving(*args)[-2:]
    assert np.array_equal(interp.backward.block_map(*args, out, lse, d_out), interp.block_map(*args))
    _check(*_gradients(spec, args, [d_out]), args)


def test_a_mask_given_as_data_over_every_tile_class():
    """m[b, i, j], a boolean tensor: each tile classified from its minimum and maximum over the tile."""
    from tests.passes.specs import dense

    rng = np.random.default_rng(3)
    args = [normal(rng, 1, 2, 40, 8), normal(rng, 1, 2, 37, 8), normal(rng, 1, 2, 37, 8)]
    rows, keys = np.arange(40)[:, None], np.arange(37)[None]
    mask = ((keys <= rows) & (rows - keys < 32))[None]
    d_out = normal(rng, 1, 2, 40, 8)
    interp = ac.compile(dense, backend="interp", pipeline=PIPELINE)
    tiles = interp.block_map(*args, mask)
    assert set(np.unique(tiles)) == {0, 1, 2} and tiles[0, 0, 1, 0] == 2 and tiles[0, 0, 2, 0] == 1
    out, lse = interp.forward_saving(*args, mask)[-2:]
    assert np.array_equal(interp.backward.block_map(*args, mask, out, lse, d_out), tiles)
    got = ac.compile(dense, backend="cuda", pipeline=PIPELINE)(*args, mask)
    assert relative_error(got, out) < 1e-5
    _check(*_gradients(dense, [*args, mask], [d_out]), [*args, mask])


def test_a_bias_per_head_given_as_data_gets_its_gradient():
    """bias[b, h, i, j] added to the scores (T5's position bias), -inf where it hides a key: the
    bias's gradient is the scores' own, element by element."""
    from tests.passes.specs import dense_bias

    rng = np.random.default_rng(4)
    args = [normal(rng, 1, 2, 40, 8), normal(rng, 1, 2, 37, 8), normal(rng, 1, 2, 37, 8), normal(rng, 1, 2, 40, 37)]
    args[3][0, 1, :, 20:] = -np.inf
    _check(*_gradients(dense_bias, args, [normal(rng, 1, 2, 40, 8)]), args)


def test_a_head_narrower_than_the_lanes_of_a_key():
    """D = E = 2 with 8 lanes per key: the padded features read zeros inside the staged tiles."""
    spec = load_example("causal").causal
    rng = np.random.default_rng(8)
    args = [normal(rng, 1, 1, 3, 2), normal(rng, 1, 1, 5, 2), normal(rng, 1, 1, 5, 2)]
    pipeline = "cse,softmax-fusion,flash-tiling{block_q=4,block_k=4},mask-elimination,canonicalize,cse,dce"
    got, want = _gradients(spec, args, [normal(rng, 1, 1, 3, 2)], pipeline)
    _check(got, want, args)


def test_a_call_runs_on_the_stream_it_is_given():
    """What fn.to_torch() does with PyTorch's current stream: every launch and copy on that stream."""
    from numba import cuda

    from attncomp.backends.numba_cuda.host.launches import on_stream, stream

    spec = load_example("alibi").causal_alibi
    rng = np.random.default_rng(5)
    args = [normal(rng, 1, 2, 20, 8), normal(rng, 1, 2, 20, 8), normal(rng, 1, 2, 20, 8)]
    args.append(np.array([0.5, 0.25], dtype=np.float32))
    fn = ac.compile(spec, backend="cuda", pipeline=PIPELINE)
    d_out = normal(rng, 1, 2, 20, 8)
    want = fn.vjp(*args)[1](d_out)
    with on_stream(cuda.stream()):
        assert stream() != 0
        got = fn.vjp(*args)[1](d_out)
    assert stream() == 0
    for g, w in zip(got, want):  # atomics add in any order: equal up to float32 rounding
        assert relative_error(g, w) < 1e-6


def test_alibi_slopes_get_their_gradient():
    spec = load_example("alibi").causal_alibi
    rng = np.random.default_rng(1)
    args = [normal(rng, 1, 2, 35, 8), normal(rng, 1, 2, 35, 8), normal(rng, 1, 2, 35, 8)]
    args.append(np.array([0.5, 0.25], dtype=np.float32))
    got, want = _gradients(spec, args, [normal(rng, 1, 2, 35, 8)])
    _check(got, want, args)


def test_a_sigmoid_gate_on_the_scores_gets_its_gradient():
    """``ac.sigmoid`` (a choice between two finite branches) inside the score region, a gate per
    head: 0 (its gradient at the choice's edge) and a large negative one."""
    from tests.passes.specs import sigmoid_gated

    rng = np.random.default_rng(2)
    args = [normal(rng, 1, 2, 35, 8), normal(rng, 1, 2, 35, 8), normal(rng, 1, 2, 35, 8)]
    args.append(np.array([0.0, -120.0], dtype=np.float32))
    got, want = _gradients(sigmoid_gated, args, [normal(rng, 1, 2, 35, 8)])
    _check(got, want, args)


def test_a_learnable_temperature_read_at_no_index():
    """A 0-d site: every score's contribution sums into one number."""
    from tests.passes.specs import learned_temperature

    rng = np.random.default_rng(7)
    args = [normal(rng, 21, 8), normal(rng, 19, 8), normal(rng, 19, 8), np.array([0.7], dtype=np.float32)]
    got, want = _gradients(learned_temperature, args, [normal(rng, 21, 8)])
    _check(got, want, args)


def test_grouped_query_heads_add_into_their_key_value_head():
    spec = load_example("gqa").grouped_query_attention
    rng = np.random.default_rng(2)
    args = [normal(rng, 1, 4, 33, 8), normal(rng, 1, 2, 30, 8), normal(rng, 1, 2, 30, 8)]
    got, want = _gradients(spec, args, [normal(rng, 1, 4, 33, 8)])
    _check(got, want, args)


def test_lse_cotangent_and_a_row_with_every_key_masked():
    """A length of 0 masks every key of batch entry 0: its gradients are zero, not NaN."""
    spec = load_example("lse").key_padding_with_lse
    rng = np.random.default_rng(3)
    q, k, v = normal(rng, 2, 1, 34, 8), normal(rng, 2, 1, 34, 8), normal(rng, 2, 1, 34, 4)
    args = [q, k, v, np.array([0, 21], dtype=np.int32)]
    cotangents = [normal(rng, 2, 1, 34, 4), normal(rng, 2, 1, 34)]
    got, want = _gradients(spec, args, cotangents)
    _check(got, want, args)
    for g in got[:3]:
        assert np.all(g[0] == 0.0)
    assert np.all(got[1][1, :, 21:] == 0.0)  # keys past the length get nothing


def test_unfused_backward_runs_op_by_op():
    """pipeline="": the backward graph is not fused (the slopes' gradient is an ac.scatter_add)."""
    spec = load_example("alibi").causal_alibi
    assert "ac.scatter_add" in ac.compile(spec, backend="interp", pipeline="").backward.ir()
    rng = np.random.default_rng(4)
    args = [normal(rng, 1, 2, 6, 4), normal(rng, 1, 2, 5, 4), normal(rng, 1, 2, 5, 4)]
    args.append(np.array([0.5, 0.25], dtype=np.float32))
    got, want = _gradients(spec, args, [normal(rng, 1, 2, 6, 4)], pipeline="")
    _check(got, want, args)


SCATTER = """
ac.func @scatter(%upd: tensor<M x N x f32>, %idx: tensor<M x 1 x i64>) -> (tensor<R x f32>) {
  %g = ac.scatter_add %upd, %idx : tensor<R x f32>
  ac.return %g
}
"""


def _scatter_module(rows: int):
    return ac.parse_ir(SCATTER.replace("R x", f"{rows} x"))


def test_scatter_add_kernel_adds_repeated_indices_and_rejects_bad_ones():
    rng = np.random.default_rng(5)
    updates = normal(rng, 7, 3)
    index = np.array([[0], [2], [2], [4], [0], [0], [1]], dtype=np.int64)
    got = ac.compile(_scatter_module(5), backend="cuda", pipeline="")(updates, index)
    want = np.zeros(5)
    np.add.at(want, np.broadcast_to(index, updates.shape), updates)
    assert relative_error(got, want) < 1e-6
    bad = index.copy()
    bad[3, 0] = 5
    with pytest.raises(IndexError, match="out of range"):
        ac.compile(_scatter_module(5), backend="cuda", pipeline="")(updates, bad)


@ac.spec
def causal64(q: ac.f64["B", "H", "T", "D"], k: ac.f64["B", "H", "S", "D"], v: ac.f64["B", "H", "S", "E"]):
    s = (q @ k.mT) * q.shape[-1] ** -0.5
    b, h, i, j = ac.index(s)
    return ac.softmax(ac.where(j <= i, s, -ac.inf), axis=-1) @ v


def test_float64_gradients():
    rng = np.random.default_rng(6)
    args = [normal(rng, 1, 1, 30, 4, dtype=np.float64), normal(rng, 1, 1, 36, 4, dtype=np.float64)]
    args.append(normal(rng, 1, 1, 36, 3, dtype=np.float64))
    got, want = _gradients(causal64, args, [normal(rng, 1, 1, 30, 3, dtype=np.float64)])
    _check(got, want, args, tolerance=1e-10)


def test_sigmoid_attention_outputs_and_gradients():
    """Sigmoid attention (an unnormalised ``ac.attention``: ``exp`` of a ``log sigmoid`` score, no row
    sum): its outputs are ``acc exp(m)``, its backward reads no log-sum-exp and no delta."""
    from tests.passes.specs import sigmoid_alibi

    rng = np.random.default_rng(4)
    args = [normal(rng, 1, 2, 35, 8), normal(rng, 1, 2, 37, 8), normal(rng, 1, 2, 37, 8)]
    args.append(np.array([0.05, 0.0], dtype=np.float32))
    d_out = normal(rng, 1, 2, 35, 8)
    out, backward = ac.compile(sigmoid_alibi, backend="cuda", pipeline=PIPELINE).vjp(*args)
    want_out, want_backward = ac.compile(sigmoid_alibi, backend="interp", pipeline=PIPELINE).vjp(*args)
    assert relative_error(out, want_out) < 1e-5
    _check(backward(d_out), want_backward(d_out), args)


def test_sigmoid_attention_in_bf16_on_the_tensor_cores():
    """The default pipeline's 16-bit forward (its output scaled by ``rcp_approx`` of ``exp(-m)``)."""
    import ml_dtypes

    rng = np.random.default_rng(5)
    q, k, v = (normal(rng, 1, 2, 70, 16).astype(ml_dtypes.bfloat16) for _ in range(3))
    want = ac.interpret(causal_sigmoid, *(np.asarray(x, np.float32) for x in (q, k, v)))
    got = np.asarray(ac.compile(causal_sigmoid, backend="cuda")(q, k, v), np.float64)
    assert relative_error(got, want) < 1e-2


@ac.spec
def causal_sigmoid(
    q: ac.floating["B", "H", "T", "D"], k: ac.floating["B", "H", "S", "D"], v: ac.floating["B", "H", "S", "D"]
):
    s = (q @ k.mT) * q.shape[-1] ** -0.5 - 1.0
    b, h, i, j = ac.index(s)
    return ac.where(j <= i, ac.sigmoid(s), 0.0) @ v
