"""Dask chunk pairs and the paged decoder through the CUDA backend: host arrays in and out."""

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


def test_paged_decoder_on_cuda():
    """A fork sharing a prompt, a step with prefill and decode together, on the CUDA backend."""
    rng = np.random.default_rng(1)
    slopes = np.array([0.5, 0.25], np.float32)
    fn = ac.compile(specs.causal_alibi, backend="cuda", window=6)
    srv = fn.paged_decoder(page_size=4, num_pages=16)
    srv.cascade_min = 4
    q, k, v = (rng.standard_normal((1, 2, 14, 8), dtype=np.float32) for _ in range(3))
    a = srv.new()
    first = srv.step({a: (q[:, :, :9], k[:, :, :9], v[:, :, :9], slopes)})[a]
    b = srv.fork(a)
    ys = srv.step(
        {
            a: (q[:, :, 9:14], k[:, :, 9:14], v[:, :, 9:14], slopes),
            b: (q[:, :, 9:10], k[:, :, 9:10], v[:, :, 9:10], slopes),
        }
    )
    assert srv.cascades == 1
    whole = ac.interpret(specs.causal_alibi, q, k, v, slopes, window=6)
    got = np.concatenate([first, ys[a]], axis=2)
    assert np.max(np.abs(got - whole)) / np.max(np.abs(whole)) < 1e-5
    assert np.max(np.abs(ys[b] - whole[:, :, 9:10])) / np.max(np.abs(whole)) < 1e-5
