"""Each row's max score, ``ac.max(s, axis=-1)`` of the masked scores beside their softmax: a result of
the fused attention (``with_max``) on the cpu backend against the float64 interpreter, in every
kernel shape (BLAS tiles, the few-row loops of a decoding step, keys split across threads, grouped
heads, bf16), exact although the online softmax rescales lazily elsewhere; decoders carry it, and
the paged decoder and a chunked (Dask) run merge it over their parts."""

import ml_dtypes
import numpy as np
import pytest

import attncomp as ac

BF16 = ml_dtypes.bfloat16


@ac.spec
def windowed_with_max(
    q: ac.floating["B", "H", "T", "D"], k: ac.floating["B", "KV", "S", "D"], v: ac.floating["B", "KV", "S", "D"]
):
    n_rep = q.shape[1] // k.shape[1]
    s = (q @ ac.repeat_kv(k, n_rep).mT) * (q.shape[-1] ** -0.5)
    b, h, i, j = ac.index(s)
    d = i + s.shape[-1] - s.shape[-2] - j
    s = ac.where((d >= 0) & (d < 200) & (i != 1), s, -ac.inf)
    return ac.softmax(s, axis=-1) @ ac.repeat_kv(v, n_rep), ac.max(s, axis=-1), ac.logsumexp(s, axis=-1)


@pytest.mark.parametrize(
    "dtype,queries,keys", [(np.float32, 70, 300), (np.float32, 1, 700), (BF16, 3, 300)], ids=["blas", "splits", "rows"]
)
def test_each_rows_max_score_is_exact_on_the_cpu(dtype, queries, keys):
    rng = np.random.default_rng(queries)
    q = rng.standard_normal((2, 4, queries, 16)).astype(dtype)
    k, v = (rng.standard_normal((2, 2, keys, 16)).astype(dtype) for _ in range(2))
    fn = ac.compile(windowed_with_max, backend="cpu")
    out, top, lse = (np.asarray(x, np.float64) for x in fn(q, k, v))
    want_out, want_top, want_lse = (
        np.asarray(x, np.float64) for x in ac.compile(windowed_with_max, backend="interp", pipeline="")(q, k, v)
    )
    assert "with_max = true" in fn.ir("softmax-fusion")
    hidden = np.isneginf(want_top)
    assert np.array_equal(np.isneginf(top), hidden) and hidden.any() == (queries > 1)  # row 1 sees no key
    # the max is one of the scores, as the kernel computed it: float32 products, bf16 rounded inputs
    assert np.abs(top[~hidden] - want_top[~hidden]).max() < 2e-6
    assert np.abs(out - want_out).max() < (1e-2 if dtype is BF16 else 1e-5)
    assert np.abs(lse[~hidden] - want_lse[~hidden]).max() < 1e-4


def test_a_decoder_returns_each_steps_max():
    rng = np.random.default_rng(2)
    q = rng.standard_normal((1, 4, 5, 16)).astype(np.float32)
    k, v = (rng.standard_normal((1, 2, 5, 16)).astype(np.float32) for _ in range(2))
    fn = ac.compile(windowed_with_max, backend="cpu")
    want = np.asarray(ac.compile(windowed_with_max, backend="interp")(q, k, v)[1])
    decoder = fn.decoder(max_len=32)
    steps = [np.asarray(decoder(q[:, :, :3], k[:, :, :3], v[:, :, :3])[1])]
    steps.append(np.asarray(decoder(q[:, :, 3:], k[:, :, 3:], v[:, :, 3:])[1]))
    np.testing.assert_allclose(np.concatenate(steps, axis=-1), want, rtol=1e-6)


def assert_results_match(got, want, what):
    """Output, max and LSE within float32's bound; the same rows see no key."""
    for n, (g, w) in enumerate(zip(got, want)):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        assert g.shape == w.shape, what
        seen = np.isfinite(w)
        assert np.array_equal(np.isneginf(g), np.isneginf(w)), f"{what}: result {n}"
        assert np.abs(np.where(seen, g, 0) - np.where(seen, w, 0)).max() < 2e-5, f"{what}: result {n}"


@ac.spec
def causal_window_with_max(
    q: ac.floating["B", "H", "T", "D"], k: ac.floating["B", "KV", "S", "D"], v: ac.floating["B", "KV", "S", "D"]
):
    n_rep = q.shape[1] // k.shape[1]
    s = (q @ ac.repeat_kv(k, n_rep).mT) * (q.shape[-1] ** -0.5)
    b, h, i, j = ac.index(s)
    s = ac.where((j <= i) & (i - j < 30) & (i != 1), s, -ac.inf)
    return ac.softmax(s, axis=-1) @ ac.repeat_kv(v, n_rep), ac.max(s, axis=-1), ac.logsumexp(s, axis=-1)


@pytest.mark.parametrize(
    "spec,backend", [(causal_window_with_max, "cpu"), (windowed_with_max, "interp")], ids=["cascade", "sizes"]
)
def test_the_paged_decoder_merges_each_rows_max(spec, backend):
    """Sequences sharing a prompt's pages (a cascade: the shared prefix's partials merge with each
    sequence's own) return each row's max, LSE and output as the whole sequence's spec does.  A
    mask aligned to the last query reads both lengths (no cascade then): they are the whole
    sequence's, as the spec run on every token sees them."""
    decoder, results = fork_and_step(spec, backend)
    assert decoder.cascades == (spec is causal_window_with_max)
    for got, want, what in results:
        assert_results_match(got, want, what)


def fork_and_step(spec, backend: str, host=np.asarray):
    """A paged decoder of ``spec`` serving a 24-token prompt, a fork of it, and a step of 3 tokens for
    each (the fork with queries of its own); the decoder, and per sequence its results (the prompt's
    and the step's joined, ``host`` bringing them to numpy) with the whole sequence's from the
    interpreter."""
    rng = np.random.default_rng(3)
    whole = [rng.standard_normal((1, h, 40, 16)).astype(np.float32) for h in (4, 2, 2)]
    reference = ac.compile(spec, backend="interp")
    decoder = ac.compile(spec, backend=backend).paged_decoder(page_size=8, num_pages=32)
    decoder.cascade_min = 8
    first = decoder.new()
    prompt = decoder.step({first: tuple(x[:, :, :24] for x in whole)})[first]
    second = decoder.fork(first)
    forked = rng.standard_normal((1, 4, 3, 16)).astype(np.float32), *(x[:, :, 24:27] for x in whole[1:])
    steps = decoder.step({first: tuple(x[:, :, 24:27] for x in whole), second: forked})
    results = []
    for seq, new_q in ((first, whole[0][:, :, 24:27]), (second, forked[0])):
        want = reference(np.concatenate([whole[0][:, :, :24], new_q], axis=2), *(x[:, :, :27] for x in whole[1:]))
        joined = zip(prompt, steps[seq])
        got = [np.concatenate([host(a), host(b)], axis=-2 if n == 0 else -1) for n, (a, b) in enumerate(joined)]
        results.append((got, want, f"sequence {seq}"))
    return decoder, results


def test_a_chunked_run_merges_each_rows_max_over_its_key_chunks():
    da = pytest.importorskip("dask.array")
    import dask

    rng = np.random.default_rng(4)
    q = rng.standard_normal((2, 4, 40, 16)).astype(np.float32)
    k, v = (rng.standard_normal((2, 2, 300, 16)).astype(np.float32) for _ in range(2))
    fn = ac.compile(windowed_with_max, backend="interp")
    lazy = fn(*(da.from_array(x, chunks=(1, 2, n, 16)) for x, n in ((q, 16), (k, 64), (v, 64))))
    assert_results_match(dask.compute(*lazy, scheduler="synchronous"), fn(q, k, v), "chunked")
