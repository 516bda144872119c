"""Incremental decoding (kv-cache-reuse): the decoder agrees with the whole sequence."""

import numpy as np
import pytest

import attncomp as ac
from tests.conftest import load_example
from tests.passes import specs


@pytest.fixture(scope="module")
def nanochat():
    return load_example("nanochat_attention")


@pytest.mark.parametrize("backend", ["interp", "cpu"])
def test_nanochat_prefill_then_steps_equals_one_call(nanochat, backend):
    rng = np.random.default_rng(0)
    inputs = nanochat.make_inputs(rng, B=1, T=164, C=24, n_head=6, n_kv_head=2)
    x, weights = inputs[0], inputs[1:]
    fn = ac.compile(nanochat.nanochat_attention, backend=backend, n_head=6, n_kv_head=2)
    whole = fn(x, *weights)
    dec = fn.decoder(max_len=256)
    steps = [dec(x[:, :100], *weights)] + [dec(x[:, t : t + 1], *weights) for t in range(100, 164)]
    decoded = np.concatenate(steps, axis=1)
    assert np.max(np.abs(decoded - whole)) / np.max(np.abs(whole)) < 1e-5
    assert dec.length == 164
    # the GQA cache holds the 2 key/value heads, not the 6 query heads
    assert dec.cache["k_cache"].shape == (1, 2, 164, 4) and dec.cache["v_cache"].shape == (1, 2, 164, 4)
    dec.reset()
    replay = [dec(x[:, :100], *weights)] + [dec(x[:, t : t + 1], *weights) for t in range(100, 164)]
    np.testing.assert_array_equal(np.concatenate(replay, axis=1), decoded)


@pytest.mark.parametrize("backend", ["interp", "cpu"])
def test_chunks_of_several_tokens_are_bottom_right_aligned(backend):
    rng = np.random.default_rng(1)
    T = 30
    q, k = (rng.standard_normal((2, 2, T, 8)).astype(np.float32) for _ in range(2))
    v = rng.standard_normal((2, 2, T, 4)).astype(np.float32)
    slopes = np.array([0.5, 0.125], np.float32)
    fn = ac.compile(specs.causal_alibi, backend=backend, window=7)
    whole = fn(q, k, v, slopes)
    dec = fn.decoder(max_len=T)
    cuts = [0, 11, 12, 20, 27, 30]
    parts = [dec(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], slopes) for a, b in zip(cuts, cuts[1:])]
    np.testing.assert_allclose(np.concatenate(parts, axis=2), whole, rtol=1e-5, atol=1e-6)


def test_overflow_and_bad_shapes_leave_the_cache_as_it_was():
    rng = np.random.default_rng(2)
    q = rng.standard_normal((1, 2, 6, 8)).astype(np.float32)
    v = rng.standard_normal((1, 2, 6, 4)).astype(np.float32)
    slopes = np.ones(2, np.float32)
    dec = ac.compile(specs.causal_alibi, backend="cpu").decoder(max_len=8)
    dec(q, q, v, slopes)
    before = {name: array.copy() for name, array in dec.cache.items()}
    with pytest.raises(ValueError, match=r"appending 6 positions to a cache holding 6 exceeds max_len = 8"):
        dec(q, q, v, slopes)
    with pytest.raises(ac.ShapeError, match="dimension D"):
        dec(q[:, :, :1], q[:, :, :1, :4], v[:, :, :1], slopes)
    with pytest.raises(ac.ShapeError, match="dimension B"):
        dec(
            np.concatenate([q, q])[:, :, :1], np.concatenate([q, q])[:, :, :1], np.concatenate([v, v])[:, :, :1], slopes
        )
    assert dec.length == 6
    for name, array in dec.cache.items():
        np.testing.assert_array_equal(array, before[name])


@ac.spec
def keys_centred_over_the_sequence(
    q: ac.f32["B", "H", "T", "D"], k: ac.f32["B", "H", "T", "D"], v: ac.f32["B", "H", "T", "D"]
):
    k = k - ac.mean(k, axis=2, keepdims=True)
    return ac.softmax(q @ k.mT) @ v


def test_a_key_path_that_mixes_positions_is_refused_naming_the_op():
    fn = ac.compile(keys_centred_over_the_sequence, backend="interp")
    message = r"%0 = ac.reduce is on the key/value path and it reduces over the key axis \(T\)"
    with pytest.raises(ac.PipelineError, match=message):
        fn.decoder(max_len=16)


def test_a_mask_reading_document_ids_is_refused():
    fn = ac.compile(specs.document, backend="interp")
    with pytest.raises(ac.PipelineError, match="reads %doc at sequence positions"):
        fn.decoder(max_len=16)


@pytest.mark.parametrize("backend", ["interp", "cpu"])
def test_mla_decoder_keeps_one_latent_cache(backend):
    """MLA's absorbed decode (examples/mla.py): the values are the latent's first 512 features, so
    kv-cache-reuse caches the latent once and reads the values as its slice."""
    mla = load_example("mla")
    rng = np.random.default_rng(2)
    q, latent = mla.make_inputs(rng, B=1, H=4, T=10, S=10, decode=True)
    fn = ac.compile(mla.mla_absorbed_decode, backend=backend)
    dec = fn.decoder(16, dtype="f32")
    ir = dec.fn.ir("kv-cache-reuse")
    assert "cache_results = 1" in ir and "%v_cache" not in ir and "ac.slice %" in ir
    steps = [dec(q[:, :, :6], latent[:, :, :6])] + [
        dec(q[:, :, t : t + 1], latent[:, :, t : t + 1]) for t in range(6, 10)
    ]
    want = mla.numpy_reference(q, latent)
    assert np.max(np.abs(np.concatenate(steps, axis=2) - want)) < 1e-5
    assert set(dec.cache) == {"k_cache"} and dec.cache["k_cache"].shape == (1, 1, 10, 576)
    np.testing.assert_array_equal(dec.cache["k_cache"], latent)
