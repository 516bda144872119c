"""The decode step's loops over 8-bit codes on bf16 dot products (``code_loops``) against float64:
every code's value from the byte tables, the scores exactly as float32 sums of exact products, the
values with each weight rounded to bf16, and the grouped loops choosing them."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from numba import njit, types

from attncomp.backends.numba_cpu.code_loops import FLOAT8, HAS_CODE_TABLES, bf16_code_axpy4, bf16_code_dots4, code_table
from attncomp.backends.numba_cpu.tile_math import group_scores, group_values, query_bits
from attncomp.backends.numba_cpu.vector_loops import code_scale

CODES = {"f8e4m3": (np.uint8, types.uint8), "f8e5m2": (np.int8, types.int8)}

needs_tables = pytest.mark.skipif(not HAS_CODE_TABLES, reason="this CPU has no AVX-512 BF16 and VBMI")


def values_of(codes: np.ndarray, cache: str) -> np.ndarray:
    """What the loops multiply a code by: its value over ``code_scale``, in float64."""
    numpy_type, numba_type = CODES[cache]
    value = codes.astype(numpy_type).view(FLOAT8[numba_type]).astype(np.float64)
    return value / code_scale(numba_type)


@pytest.mark.parametrize("cache", CODES)
def test_the_tables_hold_every_code_value_exactly(cache):
    table = code_table(CODES[cache][1]).view(ml_dtypes.bfloat16).astype(np.float64)
    want = values_of(np.arange(128, dtype=np.uint8), cache)
    assert np.array_equal(table, want, equal_nan=True)
    assert np.all(np.abs(table[np.isfinite(table) & (table != 0)]) >= 2.0**-126)  # no bf16 subnormal


@njit
def _dots(qb, ks):
    """Every ``qb[r] . ks[c]`` on ``bf16_code_dots4``, four rows and four keys a call."""
    out = np.empty((qb.shape[0], ks.shape[0]), np.float32)
    for r in range(0, qb.shape[0], 4):
        for c in range(0, ks.shape[0], 4):
            t = bf16_code_dots4(qb, r, ks, c, 0)
            for i in range(4):
                for j in range(4):
                    out[r + i, c + j] = t[4 * i + j]
    return out


@needs_tables
@pytest.mark.parametrize("cache", CODES)
def test_each_code_decodes_in_every_column(cache):
    """One-hot query rows read each key element alone: all 256 codes, at each of 64 + 32 columns
    (a chunk of 64 codes and the 32 after it)."""
    n_d = 96
    codes = np.arange(256 * 3, dtype=np.uint16).astype(np.uint8).reshape(8, n_d)
    finite = np.isfinite(values_of(codes, cache))
    codes[~finite] = 0  # an infinity times a query's zeros would be NaN
    ks = codes.astype(CODES[cache][0])
    want = values_of(codes, cache)
    for d in range(n_d):
        qb = np.zeros((4, n_d), np.uint16)
        qb[:, d] = np.array(1.0, ml_dtypes.bfloat16).view(np.uint16)
        got = _dots(qb, ks)
        assert np.array_equal(got[0], want[:, d]), d


@needs_tables
@pytest.mark.parametrize("cache", CODES)
@pytest.mark.parametrize("n_d", [64, 96, 128, 576])
def test_scores_are_float32_sums_of_exact_products(cache, n_d):
    rng = np.random.default_rng(n_d)
    q = rng.standard_normal((8, n_d)).astype(ml_dtypes.bfloat16)
    rows = rng.standard_normal((12, n_d)) * 40
    ks = rows.astype(FLOAT8[CODES[cache][1]]).view(CODES[cache][0])
    want = q.astype(np.float64) @ values_of(ks, cache).T
    got = _dots(q.view(np.uint16), ks)
    bound = np.abs(q.astype(np.float64)) @ np.abs(values_of(ks, cache)).T * n_d * 2.0**-24
    assert np.all(np.abs(got - want) <= bound)


@njit
def _axpy(sg, acc, vs, nk):
    """Rows 0 .. 3 of two heads of two query rows, the weights from column 1 on."""
    bf16_code_axpy4(sg, acc, 0, 1, 2, 3, 2, 1, vs, nk, 0)


@needs_tables
@pytest.mark.parametrize("cache", CODES)
@pytest.mark.parametrize(("n_keys", "n_e"), [(64, 128), (9, 96), (2, 32), (1, 64)])
def test_values_take_pairs_of_rows_with_weights_rounded_to_bf16(cache, n_keys, n_e):
    """Pairs of value rows; an odd last row is left (to the caller)."""
    rng = np.random.default_rng(n_keys + n_e)
    w = rng.random((4, n_keys + 1)).astype(np.float32)
    vs = (rng.standard_normal((n_keys + 1, n_e)) * 40).astype(FLOAT8[CODES[cache][1]]).view(CODES[cache][0])
    start = rng.standard_normal((4, n_e)).astype(np.float32)
    acc = start.copy()
    weights = np.concatenate([np.full((4, 1), np.nan, np.float32), w], axis=1)  # column 0 is not read
    _axpy(weights.reshape(2, 2, n_keys + 2), acc.reshape(2, 2, n_e), vs, n_keys)
    paired = n_keys - n_keys % 2
    weights = w[:, :paired].astype(ml_dtypes.bfloat16).astype(np.float64)
    want = start + weights @ values_of(vs[:paired], cache)
    scale = np.abs(start) + np.abs(weights) @ np.abs(values_of(vs[:paired], cache))
    assert np.all(np.abs(acc - want) <= scale * (paired + 1) * 2.0**-24)
    if paired:  # the rounding is to bf16: float32 weights give another sum
        exact = start + w[:, :paired].astype(np.float64) @ values_of(vs[:paired], cache)
        assert np.max(np.abs(acc - exact)) > np.max(scale) * 2.0**-20


@needs_tables
@pytest.mark.parametrize("cache", CODES)
@pytest.mark.parametrize("bf16_weights", [True, False])
def test_grouped_loops_run_codes_on_bf16_dots(cache, bf16_weights):
    """``group_scores`` with bf16 query rows and codes; ``group_values`` rounds the weights to
    bf16 only when told the output is bf16 (else float32 weights, to float32's precision)."""
    n_heads, nq, n_keys, n_d = 4, 1, 37, 128
    rng = np.random.default_rng(7)
    qt = rng.standard_normal((n_heads, 4, n_d)).astype(ml_dtypes.bfloat16).astype(np.float32)
    ks, vs = (
        (rng.standard_normal((n_keys, n_d)) * 40).astype(FLOAT8[CODES[cache][1]]).view(CODES[cache][0]) for _ in "kv"
    )
    qb = np.zeros((4, n_d), np.uint16)
    assert query_bits(qt, qb, n_heads, nq)
    sg = np.zeros((n_heads, 4, n_keys), np.float32)
    group_scores(qt, qb, True, ks, sg, np.empty(n_keys, np.float32), n_heads, nq, n_keys, 0, 0)
    want = np.einsum("gd,kd->gk", qt[:, 0].astype(np.float64), values_of(ks, cache))
    assert np.max(np.abs(sg[:, 0] - want)) / np.max(np.abs(want)) < 1e-6
    weights = rng.random((n_heads, 4, n_keys)).astype(np.float32)
    acc = np.zeros((n_heads, 4, n_d), np.float32)
    active = np.ones(n_heads, np.int64)
    group_values(weights, vs, acc, active, np.empty(n_heads, np.int64), n_heads, nq, n_keys, 0, 0, bf16_weights)
    want = np.einsum("gk,ke->ge", weights[:, 0].astype(np.float64), values_of(vs, cache))
    error = np.max(np.abs(acc[:, 0] - want)) / np.max(np.abs(want))
    assert error < (4e-3 if bf16_weights else 1e-6)
    assert (error > 1e-5) == bf16_weights
