"""The decode step's grouped-row loops (``vector_loops``, ``tile_math``) against float64."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from numba import njit

from attncomp.backends.numba_cpu.tile_math import bf16_group_scores, group_scores, group_values, query_bits
from attncomp.backends.numba_cpu.vector_loops import HAS_BF16_DOT


@njit  # no cache: a cached entry would outlive changes to the tile_math loops it calls
def _on_bf16_dots(qt, ks, sg, n_heads, nq, nk):
    qb = np.empty(((n_heads * nq + 3) // 4 * 4, qt.shape[2]), np.uint16)
    spare = np.empty(nk, np.float32)
    return query_bits(qt, qb, n_heads, nq) and bf16_group_scores(qb, ks, sg, spare, n_heads, nq, nk, 0, 0)


def _scores(qt, ks, sg, n_heads, nq, n_keys, ahead, at):
    """``group_scores`` as a kernel calls it: the query rows' bits made once, then the tile."""
    qb = np.full(((n_heads * nq + 3) // 4 * 4, qt.shape[2]), 0xFFFF, np.uint16)  # NaN until written
    spare = np.empty(at + n_keys, np.float32)
    q_bits = query_bits(qt, qb, n_heads, nq)
    group_scores(qt, qb, q_bits, ks, sg, spare, n_heads, nq, n_keys, ahead, at)
    return q_bits


def _case(n_heads, nq, n_keys, n_d, exact=True, seed=0):
    rng = np.random.default_rng(seed)
    qt = rng.standard_normal((n_heads, 4, n_d)).astype(ml_dtypes.bfloat16).astype(np.float32)
    if not exact:
        qt[0, 0, 0] += np.float32(2.0**-12)  # not a bf16 value any more
    # the keys: a tile of a cache's rows (a strided view, as the kernels pass it)
    cache = rng.standard_normal((2, n_keys + 3, n_d)).astype(ml_dtypes.bfloat16)
    ks = cache.view(np.uint16)[1, 3:]
    want = np.einsum("grd,kd->grk", qt.astype(np.float64), cache[1, 3:].astype(np.float64))
    return qt, ks, want


@pytest.mark.parametrize(
    "n_heads,nq,n_keys,n_d",
    [(4, 1, 128, 128), (4, 1, 7, 64), (3, 1, 130, 32), (2, 3, 9, 128), (8, 1, 5, 96), (1, 2, 66, 64), (4, 1, 16, 48)],
)
def test_grouped_scores_equal_float64_dot_products(n_heads, nq, n_keys, n_d):
    qt, ks, want = _case(n_heads, nq, n_keys, n_d)
    at = n_keys % 3  # where the rows begin in the tile (a page's run of it), 0 for a whole tile
    sg = np.full((n_heads, 4, at + n_keys + 2), np.nan, np.float32)
    on_dots = _scores(qt, ks, sg, n_heads, nq, n_keys, n_keys, at)
    assert on_dots == (HAS_BF16_DOT and n_heads * nq >= 2 and n_d % 32 == 0)
    got = sg[:, :nq, at : at + n_keys]
    scale = np.max(np.abs(want[:, :nq]))
    assert np.max(np.abs(got - want[:, :nq])) / scale < 1e-6
    assert np.isnan(sg[:, nq:]).all() and np.isnan(sg[:, :, at + n_keys :]).all()  # nothing past the rows, keys
    assert np.isnan(sg[:, :, :at]).all()  # nor before them


@pytest.mark.skipif(not HAS_BF16_DOT, reason="this CPU has no AVX-512 BF16 dot products")
def test_bf16_dots_are_used_where_they_give_the_same_products():
    qt, ks, want = _case(4, 1, 128, 128)
    sg = np.zeros((4, 4, 128), np.float32)
    assert _on_bf16_dots(qt, ks, sg, 4, 1, 128)
    assert np.max(np.abs(sg[:, :1] - want[:, :1])) / np.max(np.abs(want[:, :1])) < 1e-6
    inexact, ks, _ = _case(4, 1, 128, 128, exact=False)
    assert not _on_bf16_dots(inexact, ks, sg, 4, 1, 128)  # a query that is not bf16: float32 loops
    assert not _on_bf16_dots(qt[:, :, :48].copy(), ks[:, :48], sg, 4, 1, 128)  # rows not of 32s
    assert not _on_bf16_dots(qt, ks, sg, 1, 1, 128)  # one row: nothing to share a key row with
    as_floats = ks.view(ml_dtypes.bfloat16).astype(np.float32)
    assert not _on_bf16_dots(qt, as_floats, sg, 4, 1, 128)  # float32 keys


@pytest.mark.parametrize("values", ["bf16", "f32"])
@pytest.mark.parametrize(
    "n_heads,nq,n_keys,n_e,inactive",
    [(4, 1, 128, 128, ()), (5, 1, 9, 64, (1,)), (4, 2, 33, 32, (0, 3)), (8, 1, 3, 96, (2, 5)), (4, 1, 16, 48, ())],
)
def test_grouped_values_equal_float64_sums(values, n_heads, nq, n_keys, n_e, inactive):
    rng = np.random.default_rng(n_heads * 100 + n_e)
    at = n_keys % 3  # where the rows begin in the tile, as in the scores' test
    sg = rng.random((n_heads, 4, at + n_keys + 2)).astype(np.float32)
    cache = rng.standard_normal((2, n_keys + 5, n_e)).astype(ml_dtypes.bfloat16)
    vs = cache.view(np.uint16)[1, 5:] if values == "bf16" else cache.astype(np.float32)[1, 5:]
    start = rng.standard_normal((n_heads, 4, n_e)).astype(np.float32)
    acc = start.copy()
    active = np.array([g not in inactive for g in range(n_heads)], np.int64)
    group_values(sg, vs, acc, active, np.empty(n_heads * nq, np.int64), n_heads, nq, n_keys, 0, at, False)
    want = start.astype(np.float64)
    weights = sg[:, :nq, at : at + n_keys].astype(np.float64)
    product = np.einsum("grk,ke->gre", weights, cache[1, 5:].astype(np.float64))
    want[:, :nq] += product * active[:, None, None]
    assert np.max(np.abs(acc - want)) / np.max(np.abs(want)) < 1e-6
    for g in inactive:
        assert np.array_equal(acc[g], start[g])  # a head that did not compute the tile: untouched
