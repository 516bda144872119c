"""Attention dropout: ``ac.random``, ``ac.dropout`` and the fused attention's weight region.

The mask is a function of the seed and the positions (``ac.random``), so every backend draws the
same one and the backward draws it again; softmax-fusion keeps it inside the fused attention, so
no ``T x S`` tensor is built.  One spec is compiled on the cpu backend once for the file.
"""

# Dimension names in annotations (ac.f32["T", "D"]) are not forward references.
# ruff: noqa: F821, UP037

from __future__ import annotations

import numpy as np
import pytest

import attncomp as ac
from attncomp.ir.ops.random import uniform
from attncomp.testing import tolerance_for, worst_error

RATE = 0.2


@ac.spec
def dropout_gqa(
    q: ac.f32["B", "H", "T", "D"],
    k: ac.f32["B", "KV", "S", "D"],
    v: ac.f32["B", "KV", "S", "E"],
    seed: ac.i64,
    *,
    rate: float = RATE,
):
    """Causal grouped-query attention with its log-sum-exp, the probabilities dropped out."""
    n_rep = q.shape[1] // k.shape[1]
    s = (q @ ac.repeat_kv(k, n_rep).mT) * q.shape[-1] ** -0.5
    b, h, i, j = ac.index(s)
    s = ac.where(j <= i, s, -ac.inf)
    return ac.dropout(ac.softmax(s, axis=-1), rate, seed) @ ac.repeat_kv(v, n_rep), ac.logsumexp(s, axis=-1)


@ac.spec
def dropout_seed_tensor(
    q: ac.f32["B", "H", "T", "D"],
    k: ac.f32["B", "H", "S", "D"],
    v: ac.f32["B", "H", "S", "E"],
    seed: ac.i64[1],
):
    """The seed as a one-element tensor (read where the kernels run: on a GPU, no copy to the host)."""
    s = (q @ k.mT) * q.shape[-1] ** -0.5
    return ac.dropout(ac.softmax(s, axis=-1), 0.5, seed[0]) @ v


@ac.spec
def weighted_by_a_tensor(
    q: ac.f32["B", "H", "T", "D"],
    k: ac.f32["B", "H", "S", "D"],
    v: ac.f32["B", "H", "S", "E"],
    w: ac.f32["H", "T", "S"],
):
    s = (q @ k.mT) * q.shape[-1] ** -0.5
    b, h, i, j = ac.index(s)
    return (ac.softmax(s, axis=-1) * w[h, i, j]) @ v


def inputs(rng, B=1, H=4, KV=2, T=150, S=150, D=16, E=16, seed=20261129):
    q = rng.standard_normal((B, H, T, D), dtype=np.float32)
    k = rng.standard_normal((B, KV, S, D), dtype=np.float32)
    v = rng.standard_normal((B, KV, S, E), dtype=np.float32)
    return [q, k, v, np.int64(seed)]


def reference(q, k, v, seed, rate=RATE):
    """The formula in float64: softmax, then each probability kept where ``random(seed, b, h, i, j)
    >= rate`` and scaled by 1 / (1 - rate); the log-sum-exp of the scores, untouched."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    T, S = s.shape[-2:]
    s = np.where(np.arange(S)[None, :] <= np.arange(T)[:, None], s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    p = np.exp(s - m)
    total = p.sum(axis=-1, keepdims=True)
    b, h, i, j = np.ogrid[: s.shape[0], : s.shape[1], :T, :S]
    keep = uniform(seed, b, h, i, j) >= rate
    return (p / total * keep / (1 - rate)) @ v, (m + np.log(total))[..., 0]


def test_the_numbers_are_uniform_distinct_and_the_same_compiled():
    from attncomp.backends.numba_cpu.tile_math import random_step, random_unit

    i, j = np.ogrid[:256, :256]
    u = uniform(np.int64(7), i, j)
    assert u.dtype == np.float32 and u.shape == (256, 256)
    assert 0.0 <= u.min() and u.max() < 1.0
    assert np.all(u * 2**24 == np.round(u * 2**24))  # multiples of 2**-24
    assert abs(u.mean() - 0.5) < 0.01 and abs((u < RATE).mean() - RATE) < 0.01
    for rows, cols in ((u[:, :-1], u[:, 1:]), (u[:-1], u[1:])):  # neighbours independent, along both axes
        assert abs(np.corrcoef(rows.ravel(), cols.ravel())[0, 1]) < 0.02
    assert (uniform(np.int64(8), i, j) != u).mean() > 0.99  # another seed, other numbers
    for counters in [(7, 0, 0), (7, 255, 3), (-1, 12, 250), (2**62, 1, 1), (5,)]:
        state = np.uint64(0)
        for c in counters[:-1]:
            state = np.uint64(random_step(state, np.int64(c)))  # a negative counter wraps, as in uniform
        assert random_unit(state, np.int64(counters[-1])) == uniform(*(np.int64(c) for c in counters))


@pytest.mark.parametrize("spec", [dropout_gqa, dropout_seed_tensor], ids=["seed", "seed[0]"])
def test_softmax_fusion_keeps_the_dropout_in_the_fused_attention(spec):
    fn = ac.compile(spec, backend="interp")
    assert not fn.remarks, fn.remarks
    fused = ac.parse_ir(fn.ir("softmax-fusion"))
    attention = [op for op in fused.main.body.ops if op.name == "ac.attention"]
    assert len(attention) == 1 and len(attention[0].regions) == 3  # score, mask, weight
    assert "ac.random" in fn.ir("softmax-fusion") and "ac.softmax" not in fn.ir("softmax-fusion")
    tiled = fn.ir("flash-tiling")
    assert 'role = "weight"' in tiled and "T x S" not in tiled
    # the probabilities weighted by a tensor (a float argument, whose gradient fusion would lose): not fused
    remarks = ac.compile(weighted_by_a_tensor, backend="interp").remarks
    assert any("reads the floating argument %w" in r for r in remarks), remarks


def test_the_interpreter_computes_the_formula():
    args = inputs(np.random.default_rng(0), T=40, S=40)
    fn = ac.compile(dropout_gqa, backend="interp")
    out, lse = fn(*args)
    want, want_lse = reference(*args)
    assert worst_error([out, lse], [want, want_lse]) < 1e-6  # float64, rounded to the declared float32
    assert worst_error([out], ac.interpret(dropout_gqa, *args)[:1]) < 1e-6  # the traced graph's
    other, _ = fn(*args[:3], np.int64(1))
    assert np.abs(other - out).max() > 0.1  # a new seed drops other probabilities


@pytest.fixture(scope="module")
def cpu_fn():
    return ac.compile(dropout_gqa, backend="cpu")


@pytest.mark.parametrize("T", [150, 3], ids=["tiles", "few-rows"])
def test_cpu_forward_and_gradients_match_the_interpreter(cpu_fn, T):
    """150 positions: skipped, masked and full tiles of 64; 3 query rows over 150 keys: the loops
    of a decoding step.  The gradients of q, k and v redraw the forward's mask."""
    rng = np.random.default_rng(1)
    args = inputs(rng, T=T)
    ref = ac.compile(dropout_gqa, backend="interp")
    tol = tolerance_for(["f32"])
    assert worst_error(cpu_fn(*args), ref(*args)) < tol
    cotangents = [rng.standard_normal(x.shape) for x in ref(*args)]
    out, pull = cpu_fn.vjp(*args)
    ref_out, ref_pull = ref.vjp(*args)
    grads, ref_grads = pull(*cotangents), ref_pull(*cotangents)
    assert grads[3] is None and ref_grads[3] is None  # the seed's
    assert worst_error(grads[:3], ref_grads[:3]) < tol
    no_dropout = ac.compile(dropout_gqa, backend="interp", rate=0.0)
    assert worst_error(grads[:3], no_dropout.vjp(*args)[1](*cotangents)[:3]) > 0.05  # the mask matters


def test_a_rate_outside_zero_to_one_is_refused():
    with pytest.raises(ac.SpecError, match=r"rate must be in \[0, 1\), got 1.0"):
        dropout_gqa.trace(rate=1.0)
