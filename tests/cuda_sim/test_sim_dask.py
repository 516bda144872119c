"""Dask arrays through the CUDA backend: each chunk pair's kernel on the device, host chunks in and out."""

from __future__ import annotations

import numpy as np
import pytest

import attncomp as ac
from tests.passes import specs

da = pytest.importorskip("dask.array")
dask = pytest.importorskip("dask")


def test_window_alibi_chunk_pairs_on_cuda():
    rng = np.random.default_rng(0)
    q, k = (rng.standard_normal((1, 2, 20, 8), dtype=np.float32) for _ in range(2))
    v = rng.standard_normal((1, 2, 20, 4), dtype=np.float32)
    slopes = np.array([0.5, 0.25], np.float32)
    fn = ac.compile(specs.causal_alibi, backend="cuda", window=6)
    out = fn(*(da.from_array(x, chunks=(1, 1, 8, x.shape[-1])) for x in (q, k, v)), slopes)
    with dask.config.set(scheduler="sync"):
        got = out.compute()
    assert isinstance(got, np.ndarray)
    want = ac.interpret(specs.causal_alibi, q, k, v, slopes, window=6)
    assert np.max(np.abs(got - want)) / np.max(np.abs(want)) < 1e-5
