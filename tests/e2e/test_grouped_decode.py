"""Grouped-query decoding on the cpu: a task multiplies the rows of all the query heads that share a
key/value head in one pass over each key tile.  Heads whose tiles differ (per-head windows: one
head skips a tile another masks or computes in full), groups of 1 to 6 heads (four rows at a
time, and the rest), 1 to 5 new tokens (5: the tile path of many rows), float32 and bf16, each
against the float64 interpreter on the same inputs."""

# ruff: noqa: F821

import ml_dtypes
import numpy as np
import pytest

import attncomp as ac


@ac.spec
def head_windows(
    q: ac.floating["B", "H", "T", "D"], k: ac.floating["B", "KV", "S", "D"], v: ac.floating["B", "KV", "S", "D"]
):
    """GQA where query head h sees 150 (h + 1) keys up to 50 h before its own position: the heads
    of a group skip (first and last), mask and compute different key tiles."""
    n_rep = q.shape[1] // k.shape[1]
    s = (q @ ac.repeat_kv(k, n_rep).mT) * q.shape[-1] ** -0.5
    b, h, i, j = ac.index(s)
    s = ac.where((j <= i - 50 * h) & (i - j < 150 * (h + 1)), s, -ac.inf)
    return ac.softmax(s, axis=-1) @ ac.repeat_kv(v, n_rep)


@pytest.fixture(scope="module")
def fn():
    return ac.compile(head_windows, backend="cpu")


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize(("group", "new"), [(1, 1), (3, 2), (4, 1), (6, 4), (4, 5)])
def test_grouped_decode_steps_agree_with_the_interpreter(fn, dtype, group, new):
    rng = np.random.default_rng(group * 10 + new)
    kv, cached, d = 2, 437, 16
    np_type = ml_dtypes.bfloat16 if dtype == "bf16" else np.float32
    q = rng.standard_normal((1, kv * group, cached + new, d)).astype(np_type)
    k, v = (rng.standard_normal((1, kv, cached + new, d)).astype(np_type) for _ in range(2))
    dec = fn.decoder(max_len=512, dtype=dtype)
    dec(q[:, :, :cached], k[:, :, :cached], v[:, :, :cached])
    got = dec(q[:, :, cached:], k[:, :, cached:], v[:, :, cached:]).astype(np.float64)
    want = ac.interpret(head_windows, q, k, v).astype(np.float64)[:, :, cached:]
    tolerance = 1e-2 if dtype == "bf16" else 1e-5  # bf16: the result's rounding (2**-8) and more
    assert np.max(np.abs(got - want)) / np.max(np.abs(want)) < tolerance


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_paged_grouped_decode_reads_each_pages_rows_in_place(fn, dtype):
    """Decoding steps over a pool of pages: the four rows of a group multiplied with each page's run
    of a key tile's rows in place (bf16 pages on the CPU's bf16 dot products where it has them: D is
    a multiple of 32); pages of 24 rows, so that key tiles of 128 begin and end inside pages."""
    rng = np.random.default_rng(3)
    kv, group, d, n, prompt = 2, 4, 32, 300, 290
    np_type = ml_dtypes.bfloat16 if dtype == "bf16" else np.float32
    q = rng.standard_normal((1, kv * group, n, d)).astype(np_type)
    k, v = (rng.standard_normal((1, kv, n, d)).astype(np_type) for _ in range(2))
    srv = fn.paged_decoder(page_size=24, num_pages=32, dtype=dtype)
    seq = srv.new()
    outs = [srv.step({seq: (q[:, :, :prompt], k[:, :, :prompt], v[:, :, :prompt])})[seq]]
    for t in range(prompt, n):  # one token a step: the few-row loops
        outs.append(srv.step({seq: (q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1])})[seq])
    got = np.concatenate(outs, axis=2).astype(np.float64)
    want = ac.interpret(head_windows, q, k, v).astype(np.float64)
    tolerance = 1e-2 if dtype == "bf16" else 1e-5
    assert np.max(np.abs(got - want)) / np.max(np.abs(want)) < tolerance
    steps = got[:, :, prompt:] - want[:, :, prompt:]
    assert np.max(np.abs(steps)) / np.max(np.abs(want[:, :, prompt:])) < tolerance
    source = srv.paged.fn.source
    assert "slot:slot + run], sg, sg_spare, G, nq, run, 0, c0)" in source
    assert ("query_bits(qt, qt_bits, G, nq)" in source) == (dtype == "bf16")
