"""Compiled functions over Dask arrays (docs/api.md section 8): chunk pairs, pruning, merges, a cluster."""

import subprocess
import sys

import numpy as np
import pytest

import attncomp as ac
from attncomp.chunked import PAIR
from tests.conftest import load_example
from tests.passes import specs

da = pytest.importorskip("dask.array")
dask = pytest.importorskip("dask")

RTOL = 1e-5


def compute(*arrays):
    with dask.config.set(scheduler="sync"):
        return dask.compute(*arrays)


def pair_tasks(array) -> list[tuple]:
    return [key for key in dict(array.__dask_graph__()) if isinstance(key, tuple) and key[0].startswith(PAIR)]


def unmasked_pairs(array) -> int:
    graph = dict(array.__dask_graph__())
    return sum(1 for key in pair_tasks(array) if "unmasked" in graph[key][1])


def close(got, want) -> float:
    return float(np.max(np.abs(np.asarray(got, np.float64) - want)) / max(np.max(np.abs(want)), 1e-30))


def qkv(rng, B=2, H=2, T=50, S=None, D=8, E=8):
    S = T if S is None else S
    return (
        rng.standard_normal((B, H, T, D), dtype=np.float32),
        rng.standard_normal((B, H, S, D), dtype=np.float32),
        rng.standard_normal((B, H, S, E), dtype=np.float32),
    )


@pytest.fixture(scope="module")
def examples():
    names = ("sinks_window", "document_mask", "padding", "gqa", "lse", "nanochat_attention")
    return {name: load_example(name) for name in names}


def test_causal_graph_holds_the_lower_triangle_of_chunk_pairs():
    rng = np.random.default_rng(0)
    q, k, v = qkv(rng, B=1, H=2, T=64)
    fn = ac.compile(specs.causal, backend="interp")
    out = fn(*(da.from_array(x, chunks=(1, 2, 8, 8)) for x in (q, k, v)))
    n = 8
    assert len(pair_tasks(out)) == n * (n + 1) // 2  # not n * n
    # the diagonal pairs are masked, those below it proven fully visible run without the mask
    assert unmasked_pairs(out) == n * (n - 1) // 2
    (got,) = compute(out)
    assert close(got, fn(q, k, v)) < RTOL


@pytest.mark.parametrize(
    "q_chunk, k_chunk",
    [(16, 16), (13, 13), (50, 50), (16, 7)],
    ids=["even", "not-dividing", "one-chunk", "q-and-k-differ"],
)
def test_window_with_sinks_any_chunking(examples, q_chunk, k_chunk):
    rng = np.random.default_rng(1)
    q, k, v = qkv(rng, T=50)
    fn = ac.compile(examples["sinks_window"].sinks_window, backend="interp", window=9, sinks=3)
    out = fn(
        da.from_array(q, chunks=(1, 1, q_chunk, 8)),
        da.from_array(k, chunks=(1, 1, k_chunk, 8)),
        da.from_array(v, chunks=(1, 1, k_chunk, 8)),
    )
    assert out.chunks[2][0] == q_chunk and out.chunks[:2] == ((1, 1), (1, 1))
    (got,) = compute(out)
    assert close(got, fn(q, k, v)) < RTOL
    n_q, n_k = -(-50 // q_chunk), -(-50 // k_chunk)
    if n_q * n_k > 4:  # the sinks column and the band; the rest of the triangle is pruned
        assert len(pair_tasks(out)) < 2 * 2 * n_q * n_k


def test_document_mask_prunes_pairs_from_per_chunk_document_ids(examples):
    rng = np.random.default_rng(2)
    q, k, v = qkv(rng, B=2, H=2, T=64)
    doc = np.repeat(np.array([[0, 1, 2, 3], [0, 0, 1, 1]], np.int32), 16, axis=1)  # documents of 16 and 32
    fn = ac.compile(examples["document_mask"].causal_document_mask, backend="cpu")
    chunks = (1, 2, 16, 8)
    out = fn(*(da.from_array(x, chunks=chunks) for x in (q, k, v)), da.from_array(doc, chunks=(1, 16)))
    # batch 0: the 4 diagonal pairs; batch 1: two documents of 2 chunks, 3 pairs each
    assert len(pair_tasks(out)) == 4 + 6
    # pairs inside one document below the diagonal run without the mask
    assert unmasked_pairs(out) == 2
    (got,) = compute(out)
    assert close(got, fn(q, k, v, doc)) < RTOL


def test_padded_lengths_per_batch_chunk(examples):
    rng = np.random.default_rng(3)
    q, k, v = qkv(rng, B=3, H=2, T=40)
    lengths = np.array([40, 9, 0], np.int32)  # one batch entry has no key at all: zeros
    fn = ac.compile(examples["padding"].causal_key_padding, backend="interp")
    out = fn(*(da.from_array(x, chunks=(1, 2, 10, 8)) for x in (q, k, v)), lengths)
    (got,) = compute(out)
    want = fn(q, k, v, lengths)
    assert close(got, want) < RTOL
    assert not np.any(got[2])
    # batch 0 the triangle (10), batch 1 keys < 9 only (4 pairs, one chunk column), batch 2 none
    assert len(pair_tasks(out)) == 10 + 4


@pytest.mark.parametrize(
    "name, kv_heads, k_chunks",
    [("grouped_query_attention", 2, (1, 1, 10, 8)), ("multi_query_attention", 1, (1, 1, 15, 8))],
)
def test_shared_key_value_heads_keep_the_head_axis_whole(examples, name, kv_heads, k_chunks):
    rng = np.random.default_rng(4)
    q = rng.standard_normal((2, 4, 30, 8), dtype=np.float32)
    k, v = (rng.standard_normal((2, kv_heads, 30, 8), dtype=np.float32) for _ in range(2))
    fn = ac.compile(getattr(examples["gqa"], name), backend="interp")
    out = fn(da.from_array(q, chunks=(1, 2, 10, 8)), da.from_array(k, chunks=k_chunks), v)
    # query heads sharing a key/value head stay in one task, which reads each key chunk once
    assert out.chunks[:3] == ((1, 1), (4,), (10, 10, 10))
    (got,) = compute(out)
    assert close(got, fn(q, k, v)) < RTOL


def test_output_and_lse(examples):
    rng = np.random.default_rng(6)
    q, k, v = qkv(rng, T=33)
    fn = ac.compile(examples["lse"].causal_with_lse, backend="interp")
    out, lse = fn(*(da.from_array(x, chunks=(2, 1, 8, 8)) for x in (q, k, v)))
    assert lse.shape == (2, 2, 33) and lse.chunks[2] == (8, 8, 8, 8, 1)
    got_out, got_lse = compute(out, lse)
    want_out, want_lse = fn(q, k, v)
    assert close(got_out, want_out) < RTOL and close(got_lse, want_lse) < RTOL


@pytest.mark.parametrize("backend", ["interp", "cpu"])
def test_nanochat_layer_runs_projections_and_rotary_blockwise(examples, backend):
    nanochat = examples["nanochat_attention"]
    rng = np.random.default_rng(7)
    x, *weights = nanochat.make_inputs(rng, B=2, T=45, C=24, n_head=6, n_kv_head=2)
    fn = ac.compile(nanochat.nanochat_attention, backend=backend, n_head=6, n_kv_head=2)
    y = fn(da.from_array(x, chunks=(1, 16, 24)), *weights)
    assert y.chunks == ((1, 1), (16, 16, 13), (24,))
    assert len(pair_tasks(y)) == 2 * 6
    (got,) = compute(y)
    assert close(got, fn(x, *weights)) < RTOL
    parts = fn.chunk_parts()
    assert sorted(parts) == ["attention", "attention_unmasked", "inputs", "outputs"]
    assert "chunk-pairs" in parts["inputs"].stages and "ac.matmul" in parts["outputs"].ir("final")


def test_alibi_with_batch_and_head_chunks_on_cpu():
    rng = np.random.default_rng(8)
    q, k, v = qkv(rng, B=2, H=4, T=40, E=4)
    slopes = np.linspace(0.5, 0.05, 4, dtype=np.float32)
    fn = ac.compile(specs.causal_alibi, backend="cpu", window=7)
    # keys chunked otherwise along batch and heads: they follow the queries' chunks
    k_lazy, v_lazy = (da.from_array(x, chunks=(2, 4, 16, x.shape[-1])) for x in (k, v))
    out = fn(da.from_array(q, chunks=(1, 2, 16, 8)), k_lazy, v_lazy, da.from_array(slopes, chunks=2))
    (got,) = compute(out)
    assert close(got, fn(q, k, v, slopes)) < RTOL
    # 4 (batch, head) chunks, each the band of a window of 7 over chunks of 16: 1 + 2 + 2 pairs
    assert len(pair_tasks(out)) == 4 * 5


@ac.spec
def centred_keys(q: ac.f32["B", "H", "T", "D"], k: ac.f32["B", "H", "T", "D"], v: ac.f32["B", "H", "T", "D"]):
    k = k - ac.sum(k, 2, keepdims=True)
    return ac.softmax(q @ k.mT) @ v


def test_an_op_mixing_positions_is_refused_by_name():
    x = da.zeros((1, 1, 16, 4), chunks=(1, 1, 8, 4), dtype=np.float32)
    fn = ac.compile(centred_keys, backend="interp")
    with pytest.raises(ac.PipelineError, match=r"ac\.reduce .* reduces over the axis T"):
        fn(x, x, x)


def test_bad_shapes_are_named_before_any_graph():
    x = da.zeros((1, 2, 16, 8), chunks=(1, 1, 8, 8), dtype=np.float32)
    y = da.zeros((1, 2, 16, 4), chunks=(1, 1, 8, 4), dtype=np.float32)
    fn = ac.compile(specs.causal, backend="interp")
    with pytest.raises(ac.ShapeError, match="dimension D"):
        fn(x, y, x)


def test_importing_attncomp_does_not_import_dask():
    code = "import sys, attncomp; assert 'dask' not in sys.modules, 'dask was imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_local_cluster_of_two_processes_builds_each_part_once_per_worker():
    distributed = pytest.importorskip("dask.distributed")
    from attncomp.chunked import tasks

    rng = np.random.default_rng(9)
    q, k, v = qkv(rng, B=2, H=4, T=40, E=4)
    slopes = np.linspace(0.5, 0.05, 4, dtype=np.float32)
    fn = ac.compile(specs.causal_alibi, backend="cpu", window=7)
    out = fn(da.from_array(q, chunks=(1, 2, 16, 8)), k, v, slopes)
    compute(out)  # compiles here first, so the workers load the kernels from the disk cache
    with (
        distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as cluster,
        distributed.Client(cluster) as client,
    ):
        got = out.compute()
        built = client.run(tasks.builds)
    assert close(got, fn(q, k, v, slopes)) < RTOL
    assert len(built) == 2
    for counts in built.values():  # 20 pair tasks, but each worker built each part at most once
        assert counts and all(n == 1 for n in counts.values())


@ac.spec
def keys_from_the_second(q: ac.f32["B", "H", "T", "D"], k: ac.f32["B", "H", "S", "D"], v: ac.f32["B", "H", "S", "D"]):
    s = (q @ k.mT) * q.shape[-1] ** -0.5
    b, h, i, j = ac.index(s)
    return ac.softmax(ac.where(j >= 1, s, -ac.inf), axis=-1) @ v


def test_a_chunk_whose_keys_the_tightened_bounds_skip_is_zeros():
    """Mask-elimination's loop bounds leave a one-key chunk no key block at all: the pair's class
    is read from the grid's key blocks (none visited), and its rows get zeros."""
    pipeline = "cse,softmax-fusion,flash-tiling{block_q=4,block_k=4},mask-elimination,canonicalize,cse,dce"
    fn = ac.compile(keys_from_the_second, backend="interp", pipeline=pipeline)
    q, k, v = qkv(np.random.default_rng(5), B=1, H=1, T=3, S=5)
    for keys in (1, 5):
        (got,) = compute(fn(da.from_array(q, chunks=(1, 1, 2, 8)), *(da.from_array(x[:, :, :keys]) for x in (k, v))))
        want = fn(q, k[:, :, :keys], v[:, :, :keys])
        assert np.array_equal(got == 0, want == 0) and close(got, want) < RTOL


def test_a_pipeline_without_softmax_fusion_runs_chunked():
    """The parts are cut at the fused attention: a pipeline that has no softmax-fusion gets it
    first, as a decoder's does."""
    fn = ac.compile(keys_from_the_second, backend="interp", pipeline="")
    q, k, v = qkv(np.random.default_rng(6), B=1, H=1, T=6, S=7)
    (got,) = compute(fn(*(da.from_array(x, chunks=(1, 1, 3, 8)) for x in (q, k, v))))
    assert close(got, fn(q, k, v)) < RTOL


@pytest.mark.parametrize("rows, cols", [(16, 16), (4, 8), (12, 5)])
def test_a_table_of_blocks_in_chunks_at_their_offsets(rows, cols):
    """A mask read from a table of blocks at ``(i + q_start) // rows``: each chunk pair's tiles are
    classified from the entries their absolute positions reach, chunks and tiles not aligned to
    the blocks."""
    pipeline = "cse,softmax-fusion,flash-tiling{block_q=8,block_k=8},mask-elimination,canonicalize,cse,dce"
    fn = ac.compile(specs.block_table, backend="interp", pipeline=pipeline, rows=rows, cols=cols)
    rng = np.random.default_rng(rows)
    q, k, v = qkv(rng, B=1, H=2, T=45, S=37, D=4, E=4)
    table = rng.integers(0, 3, (2, -(-45 // rows), -(-37 // cols))).astype(np.int32)
    (got,) = compute(fn(*(da.from_array(x, chunks=(1, 2, 13, 4)) for x in (q, k, v)), table))
    want = ac.compile(specs.block_table, backend="interp", pipeline="", rows=rows, cols=cols)(q, k, v, table)
    assert close(got, want) < RTOL
