"""A tiny Llama (4 query heads over 2 key/value heads) on attncomp against the same weights on ``sdpa``."""

from __future__ import annotations

import pytest

from tests.conftest import TORCH_COMPILE
from tests.hf.models import (
    VOCAB,
    T,
    assert_same_dropout,
    assert_same_model_outputs,
    llama_config,
    logits_and_grads,
    model_pair,
    padded_batch,
)

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def llama():
    return model_pair(llama_config)


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch_logits_and_gradients_match_sdpa(llama, side):
    ids, mask = padded_batch(side)
    assert_same_model_outputs(*llama, ids, mask)


@pytest.mark.parametrize("cache", [None, "static"])
def test_greedy_generate_with_left_padding_gives_sdpas_tokens(llama, cache):
    """With a static cache, ``generate`` builds each step's mask ahead (the mask function's facts) and
    hands it to the model, whose mask builder passes it back to the mask function."""
    ours, theirs = llama
    ids, mask = padded_batch("left", seed=1)
    settings = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    if cache:
        settings["cache_implementation"] = cache
    with torch.no_grad():
        tokens = ours.generate(ids, **settings)
        expected = theirs.generate(ids, **settings)
    assert tokens.shape == (3, T + 6)
    assert torch.equal(tokens, expected)


def test_packed_sequences_equal_their_sequences_run_one_by_one(llama):
    """Restarting ``position_ids`` (HF's flattening collator) make documents that never see each other."""
    ours, theirs = llama
    lengths = [5, 4, 3]
    generator = torch.Generator().manual_seed(2)
    pieces = [torch.randint(1, VOCAB, (1, n), generator=generator) for n in lengths]
    packed = torch.cat(pieces, dim=1)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():  # transformers looks for packed sequences only without a cache, as in training
        logits = ours(input_ids=packed, position_ids=positions, use_cache=False).logits
        alone = torch.cat([ours(input_ids=piece, use_cache=False).logits for piece in pieces], dim=1)
        reference = theirs(input_ids=packed, position_ids=positions, use_cache=False).logits
    torch.testing.assert_close(logits, alone, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-5)
    # and the documents do matter: without the restarts the later tokens see the earlier pieces
    with torch.no_grad():
        unpacked = ours(input_ids=packed, use_cache=False).logits
    assert not torch.allclose(unpacked[:, lengths[0] :], logits[:, lengths[0] :], atol=1e-3)


def test_training_steps_follow_sdpas_losses():
    ours, theirs = model_pair(llama_config, seed=3)
    ours.train(), theirs.train()
    generator = torch.Generator().manual_seed(3)
    batches = [torch.randint(1, VOCAB, (2, T), generator=generator)] * 5  # one batch, memorised
    curves = []
    for model in (ours, theirs):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for ids in batches:
            loss = model(input_ids=ids, labels=ids).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        curves.append(losses)
    assert curves[0][-1] < curves[0][0]  # it learns
    torch.testing.assert_close(torch.tensor(curves[0]), torch.tensor(curves[1]), rtol=1e-4, atol=1e-5)


@TORCH_COMPILE
def test_compiled_forward_and_backward_have_no_graph_break(llama):
    ours, theirs = llama
    ids = torch.randint(1, VOCAB, (2, T), generator=torch.Generator().manual_seed(4))
    compiled = torch.compile(ours.forward, fullgraph=True, backend="aot_eager")
    ours.zero_grad(set_to_none=True)
    out = compiled(input_ids=ids, labels=ids)
    out.loss.backward()
    grad = ours.model.layers[0].self_attn.q_proj.weight.grad.clone()
    theirs.zero_grad(set_to_none=True)
    expected = theirs(input_ids=ids, labels=ids)
    expected.loss.backward()
    torch.testing.assert_close(out.logits, expected.logits, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(grad, theirs.model.layers[0].self_attn.q_proj.weight.grad, rtol=1e-4, atol=1e-5)


@TORCH_COMPILE
def test_compiled_with_dynamic_lengths_has_no_graph_break(llama):
    """``dynamic=True``: the layer's scale (``D ** -0.5``) is read from the sizes inside the spec, not
    made a constant of the trace, so two lengths run through one fullgraph trace."""
    ours, theirs = llama
    compiled = torch.compile(ours.forward, fullgraph=True, dynamic=True, backend="aot_eager")
    for length in (T, T - 3):
        ids = torch.randint(1, VOCAB, (2, length), generator=torch.Generator().manual_seed(length))
        with torch.no_grad():
            torch.testing.assert_close(
                compiled(input_ids=ids).logits, theirs(input_ids=ids).logits, rtol=1e-4, atol=1e-5
            )


def test_bfloat16_model_runs_in_bfloat16_close_to_sdpa():
    ours, theirs = model_pair(llama_config, seed=5)
    ours, theirs = ours.to(torch.bfloat16), theirs.to(torch.bfloat16)
    ids = torch.randint(1, VOCAB, (2, T), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        logits = ours(input_ids=ids).logits
        expected = theirs(input_ids=ids).logits
    assert logits.dtype == torch.bfloat16
    assert (logits.float() - expected.float()).abs().max() < 3e-2 * expected.float().abs().max()


def test_attention_dropout_in_training_is_the_eager_attentions_with_the_same_mask(monkeypatch):
    """A model in training mode with an attention dropout rate drops out attention (it was refused):
    against transformers' eager attention whose dropout draws the same mask law (``ac.random`` of a
    seed from torch's generator and the positions), logits, loss and every gradient agree."""
    rate = 0.25
    ours, theirs = model_pair(llama_config, reference="eager", seed=4, attention_dropout=rate)
    ids, mask = padded_batch("right")
    logits = assert_same_dropout(ours, theirs, ids, mask, rate, monkeypatch)
    # the dropout does drop: another seed, another mask; eval mode, none
    torch.manual_seed(12)
    real = mask.bool()
    again = logits_and_grads(ours.train(), ids, mask)[0]
    assert (again[real] - logits[real]).abs().max() > 1e-2
    ours.eval(), theirs.eval()
    with torch.no_grad():
        torch.testing.assert_close(
            ours(input_ids=ids, attention_mask=mask).logits[real],
            theirs(input_ids=ids, attention_mask=mask).logits[real],
            rtol=1e-4,
            atol=1e-5,
        )
