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


def test_the_pool_stays_on_the_device():
    """Pages are device arrays, written in place (copies on write included), read by the kernel
    through the page table; a sequence reads back what was appended to it."""
    from attncomp.backends.numba_cuda.host.arrays import is_device

    rng = np.random.default_rng(2)
    fn = ac.compile(specs.causal_alibi, backend="cuda", window=6)
    srv = fn.paged_decoder(page_size=4, num_pages=8)
    q, k, v = (rng.standard_normal((1, 2, 7, 8), dtype=np.float32) for _ in range(3))
    a = srv.new()
    srv.step({a: (q[:, :, :6], k[:, :, :6], v[:, :, :6], SLOPES)})
    assert all(is_device(x) for x in srv.pool.arrays)
    assert "_table[" in srv.paged.fn.source  # key and value rows read through the page table
    b = srv.fork(a)
    srv.step({b: (q[:, :, 6:], k[:, :, 6:], v[:, :, 6:], SLOPES)})  # b's last page is copied, then written
    assert srv.pages_free == 5
    keys, values = srv.pool.read(a, 0, 6)
    np.testing.assert_array_equal(keys, k[:, :, :6])
    keys, values = srv.pool.read(b, 0, 7)
    np.testing.assert_array_equal(values, v)


def test_a_steps_appends_write_each_page_array_once():
    """Three sequences append in one step (two sharing a partial last page: the first copies it on
    write, the second then writes it in place): one copy-in and one launch per page array for all
    of them, and each sequence reads back its own positions."""
    from attncomp.backends.numba_cuda.host.launch_times import launch_times

    rng = np.random.default_rng(3)
    srv = ac.compile(specs.causal_alibi, backend="cuda", window=6).paged_decoder(page_size=4, num_pages=12)
    q, k, v = (rng.standard_normal((3, 2, 9, 8), dtype=np.float32) for _ in range(3))
    a, c = srv.new(), srv.new()
    srv.step(
        {a: (q[:1, :, :6], k[:1, :, :6], v[:1, :, :6], SLOPES), c: (q[2:, :, :5], k[2:, :, :5], v[2:, :, :5], SLOPES)}
    )
    b = srv.fork(a)  # b shares a's partial last page
    k[1, :, :6], v[1, :, :6] = k[0, :, :6], v[0, :, :6]
    batch = {
        a: (q[:1, :, 6:8], k[:1, :, 6:8], v[:1, :, 6:8], SLOPES),
        b: (q[1:2, :, 6:7], k[1:2, :, 6:7], v[1:2, :, 6:7], SLOPES),
        c: (q[2:, :, 5:9], k[2:, :, 5:9], v[2:, :, 5:9], SLOPES),
    }
    with launch_times() as records:
        srv.step(batch)
    names = [r.kernel for r in records]
    assert names.count("_write_rows") == 2 and names.count("_copy_page") == 2  # keys and values
    for seq, (batch_entry, length) in {a: (0, 8), b: (1, 7), c: (2, 9)}.items():
        keys, values = srv.pool.read(seq, 0, length)
        np.testing.assert_array_equal(keys[0], k[batch_entry, :, :length])
        np.testing.assert_array_equal(values[0], v[batch_entry, :, :length])


@pytest.mark.parametrize("name", ["alibi", "sinks", "gqa", "nanochat"])
def test_sequences_over_a_device_pool(name):
    """Random prefill and decode steps, forks and frees: each sequence's outputs equal one call
    of the spec on its whole history (the e2e workload, smaller)."""
    from tests.conftest import load_example
    from tests.e2e import test_paged_decoder as e2e

    examples = {n: load_example(n) for n in ("sinks_window", "gqa", "nanochat_attention")}
    case = e2e.alibi_case("cuda") if name == "alibi" else getattr(e2e, f"{name}_case")("cuda", examples)
    srv = e2e.serve(case, seed=7, page_size=4, num_pages=64, steps=2 if name == "nanochat" else 4)
    assert srv.pool.storage.__class__.__name__ == "DevicePages"


def test_a_failed_step_leaves_the_device_pool_as_it_was():
    from tests.e2e.test_paged_decoder import PoolExhausted, snapshot, tokens

    rng = np.random.default_rng(5)
    srv = ac.compile(specs.causal_alibi, backend="cuda", window=6).paged_decoder(page_size=4, num_pages=5)
    a = srv.new()
    srv.step({a: tokens(rng, 9)})
    b = srv.fork(a)
    before = snapshot(srv)
    bad = [
        ({a: tokens(rng), b: tokens(rng, 9)}, PoolExhausted, r"needs 3 pages, 2 are free \(of 5\)"),
        ({a: tokens(rng), b: tokens(rng, heads=3)}, ac.ShapeError, "slopes: dimension H is 2"),
    ]
    for batch, error, message in bad:
        with pytest.raises(error, match=message):
            srv.step(batch)
        assert snapshot(srv) == before


SLOPES = np.array([0.5, 0.25], np.float32)
