"""Sliding windows (Mistral; both sides in ModernBERT), soft-capping with alternating windows
(Gemma 2), learned positions without rotary embeddings (GPT-2), attention sinks (gpt-oss) and
chunked attention (Llama 4), each against its own model on ``sdpa`` or, where ``sdpa`` cannot
express the layer (soft-capping, sinks), on ``eager``."""

from __future__ import annotations

import pytest

from tests.conftest import TORCH_COMPILE
from tests.hf.models import (
    CHUNK,
    IMAGE,
    VOCAB,
    WINDOW,
    T,
    assert_same_model_outputs,
    gemma2_config,
    gemma3_config,
    gpt2_config,
    gpt_oss_config,
    llama4_config,
    mistral_config,
    model_pair,
    modernbert_config,
    padded_batch,
    t5_config,
)

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def mistral():
    return model_pair(mistral_config)


@pytest.mark.parametrize("side", ["left", "right"])
def test_mistral_sliding_window_matches_sdpa_on_padded_batches(mistral, side):
    ids, mask = padded_batch(side)
    assert_same_model_outputs(*mistral, ids, mask)


@TORCH_COMPILE
def test_mistral_compiles_whole_under_torch_compile(mistral):
    """A sliding window's mask function is read without opening its closure, which a fullgraph trace
    cannot do (it lost the function's own cells, and the trace failed)."""
    ours, theirs = mistral
    ids = torch.randint(1, VOCAB, (2, T), generator=torch.Generator().manual_seed(6))
    compiled = torch.compile(ours.forward, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        torch.testing.assert_close(compiled(input_ids=ids).logits, theirs(input_ids=ids).logits, rtol=1e-4, atol=1e-5)


@TORCH_COMPILE
def test_gemma2_compiles_whole_its_two_specs_made_in_the_trace(monkeypatch):
    """Sliding and full layers: two specs, both compiled while the trace runs (none compiled before);
    the trace finds the second one too (a dict it had read before the second compile did not hold it)."""
    import attncomp.hf.attention as attention
    from attncomp.torch.traced_ops import TracedOps

    monkeypatch.setattr(attention, "OPS", TracedOps())
    ours, theirs = model_pair(gemma2_config, reference="eager")
    ids = torch.randint(1, VOCAB, (2, T), generator=torch.Generator().manual_seed(7))
    compiled = torch.compile(ours.forward, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        torch.testing.assert_close(compiled(input_ids=ids).logits, theirs(input_ids=ids).logits, rtol=1e-4, atol=1e-5)
    assert len(attention.OPS) == 2


@TORCH_COMPILE
def test_gemma2_compiles_with_dynamic_sizes_its_layer_numbers_made_constants(monkeypatch):
    """``dynamic=True`` makes a module's numbers symbols of the trace (Gemma 2's ``scaling``, here not
    ``D ** -0.5``, its soft-cap, window and dropout rate), which a spec compiles in: the trace takes
    their values, guarded, and runs fullgraph over two lengths; in training mode the dropout specs,
    made when the attention was registered, are found by the trace (they were made inside it, and missing)."""
    import attncomp.hf.attention as attention
    from attncomp.torch.traced_ops import TracedOps

    monkeypatch.setattr(attention, "OPS", TracedOps())
    ours, theirs = model_pair(gemma2_config, reference="eager", query_pre_attn_scalar=8, attention_dropout=0.25)
    assert ours.model.layers[0].self_attn.scaling != ours.config.head_dim**-0.5
    compiled = torch.compile(ours.forward, fullgraph=True, dynamic=True, backend="aot_eager")
    for length in (T, T - 3):
        ids = torch.randint(1, VOCAB, (2, length), generator=torch.Generator().manual_seed(length))
        with torch.no_grad():
            torch.testing.assert_close(
                compiled(input_ids=ids).logits, theirs(input_ids=ids).logits, rtol=1e-4, atol=1e-5
            )
    ours.train()
    ids = torch.randint(1, VOCAB, (2, T), generator=torch.Generator().manual_seed(8))
    compiled(input_ids=ids, labels=ids).loss.backward()
    grad = ours.model.layers[0].self_attn.q_proj.weight.grad
    assert grad is not None and torch.isfinite(grad).all() and grad.abs().max() > 0
    assert len(attention.OPS) == 4  # sliding and full layers, without and with dropout


def test_mistral_generates_past_its_window_as_sdpa_does(mistral):
    """Eight new tokens after a 12-token prompt: the cache slides past the 4-token window."""
    ours, theirs = mistral
    ids, mask = padded_batch("left", seed=6)
    settings = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        tokens = ours.generate(ids, **settings)
        expected = theirs.generate(ids, **settings)
    assert torch.equal(tokens, expected)


@pytest.mark.parametrize("side", ["left", "right"])
def test_gemma2_softcap_and_alternating_windows_match_eager(side):
    ours, theirs = model_pair(gemma2_config, reference="eager")
    assert [layer.self_attn.sliding_window for layer in ours.model.layers] == [WINDOW, None]
    assert ours.config.attn_logit_softcapping == 50.0
    # the cap changes the attention only where scores come near it: make them large
    with torch.no_grad():
        for layer in (*ours.model.layers, *theirs.model.layers):
            layer.self_attn.q_proj.weight.mul_(40.0)
    ids, mask = padded_batch(side, seed=7)
    assert_same_model_outputs(ours, theirs, ids, mask, rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("side", ["left", "right"])
def test_gpt2_without_rotary_embeddings_matches_sdpa(side):
    ids, mask = padded_batch(side, seed=8)
    assert_same_model_outputs(*model_pair(gpt2_config), ids, mask)


def test_gpt_oss_attention_sinks_match_eager():
    ours, theirs = model_pair(gpt_oss_config, reference="eager")
    with torch.no_grad():  # sinks large enough to take a visible share of each row
        for model in (ours, theirs):
            for layer in model.model.layers:
                layer.self_attn.sinks.copy_(torch.linspace(-1.0, 2.0, 4))
    ids, mask = padded_batch("left", seed=9)
    assert_same_model_outputs(ours, theirs, ids, mask)
    sinks = [p for n, p in ours.named_parameters() if n.endswith("sinks")]
    assert sinks and all(p.grad is not None and p.grad.abs().sum() > 0 for p in sinks)


def test_unpadded_batch_without_a_mask_matches_sdpa(mistral):
    ids = padded_batch("right", seed=10, lengths=(T, T))[0]
    assert_same_model_outputs(*mistral, ids, None)


@pytest.fixture(scope="module")
def llama4():
    return model_pair(llama4_config)


@pytest.mark.parametrize("side", ["left", "right", "none"])
def test_llama4_chunked_attention_matches_sdpa(llama4, side):
    """Chunks of 4 tokens counted from each row's first real token (left padding shifts them)."""
    ours, theirs = llama4
    assert ours.config.layer_types == ["chunked_attention", "full_attention"]
    ids, mask = padded_batch("left" if side == "none" else side, seed=8)
    if side == "none":
        mask = None
    assert_same_model_outputs(ours, theirs, ids, mask)
    with torch.no_grad():  # the chunks matter here: attending across them gives other logits
        unchunked = model_pair(llama4_config, attention_chunk_size=64)[1]
        assert not torch.allclose(unchunked(input_ids=ids).logits, theirs(input_ids=ids).logits, atol=1e-3)


def test_llama4_generates_across_chunks_as_sdpa_does(llama4):
    """Nine new tokens after a left-padded 12-token prompt: decoding steps cross two chunk
    boundaries of 4 tokens, the cache's keys before each boundary no longer seen."""
    ours, theirs = llama4
    ids, mask = padded_batch("left", seed=9)
    settings = dict(attention_mask=mask, max_new_tokens=2 * CHUNK + 1, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        tokens = ours.generate(ids, **settings)
        expected = theirs.generate(ids, **settings)
    assert torch.equal(tokens, expected)


def test_gemma3_images_on_sliding_layers_match_sdpa():
    """An image's 4 tokens see each other on both layers: on the full layer through the blocks read
    from the mask function, on the sliding one (blocks OR causal, AND the window: custom overlays)
    through the mask evaluated pair by pair, as data. Left padding, logits and greedy tokens."""
    ours, theirs = model_pair(gemma3_config)
    ids, mask = padded_batch("left", seed=11, lengths=(T, 9))
    ids[0, 2:6], ids[1, 6:10] = IMAGE, IMAGE
    images = dict(pixel_values=torch.randn(2, 3, 28, 28, generator=torch.Generator().manual_seed(0)))
    images["token_type_ids"] = (ids == IMAGE).long()
    with torch.no_grad():
        logits = ours(input_ids=ids, attention_mask=mask, **images).logits
        want = theirs(input_ids=ids, attention_mask=mask, **images).logits
        real = mask.bool()
        torch.testing.assert_close(logits[real], want[real], rtol=1e-4, atol=1e-5)
        causal = ours(input_ids=ids, attention_mask=mask, pixel_values=images["pixel_values"]).logits
        assert not torch.allclose(causal[real], want[real], atol=1e-3)  # without the blocks: other logits
        settings = dict(attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0, **images)
        assert torch.equal(ours.generate(ids, **settings), theirs.generate(ids, **settings))


def test_t5_relative_position_bias_matches_sdpa():
    """T5's learned relative positions reach the attention as ``position_bias`` (``[1, H, T, S]``):
    added to the scores of the encoder, the decoder (causal) and the cross-attention (zeros), on top
    of the padding; logits, loss, every gradient (the bias's embedding included) and greedy tokens."""
    ours, theirs = model_pair(t5_config)
    ids, mask = padded_batch("left", seed=12)
    assert_same_model_outputs(ours, theirs, ids, mask)
    bias = ours.encoder.block[0].layer[0].SelfAttention.relative_attention_bias.weight
    assert bias.grad is not None and bias.grad.abs().sum() > 0
    settings = dict(attention_mask=mask, max_new_tokens=4, do_sample=False)
    with torch.no_grad():
        assert torch.equal(ours.generate(ids, **settings), theirs.generate(ids, **settings))


@pytest.mark.parametrize("side", ["left", "right"])
def test_modernbert_two_sided_local_windows_match_sdpa(side):
    """An encoder whose local layers show a token the tokens at most 2 positions away on either side
    (a bidirectional sliding window): the window's both edges, padding, and the global layer."""
    ours, theirs = model_pair(modernbert_config)
    assert ours.config.layer_types == ["full_attention", "sliding_attention"]
    assert_same_model_outputs(ours, theirs, *padded_batch(side))
