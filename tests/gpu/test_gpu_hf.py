"""Hugging Face models on the cuda backend: ``attncomp.hf.register("attncomp_cuda", backend="cuda")``
runs a model's attention on CUDA tensors in place; logits, gradients and greedy generation against
the same weights on ``sdpa`` on the GPU (the tiny models of ``tests/hf/models.py``)."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch", reason="the torch extra is not installed")
transformers = pytest.importorskip("transformers", reason="the hf extra is not installed")
if not torch.cuda.is_available():
    pytest.skip("PyTorch sees no CUDA GPU", allow_module_level=True)

import attncomp.hf  # noqa: E402
from tests.hf.models import (  # noqa: E402
    VOCAB,
    T,
    assert_same_dropout,
    llama_config,
    logits_and_grads,
    mistral_config,
    padded_batch,
    t5_config,
)
from tests.hf.test_masks_and_specs import packed_4d_mask  # noqa: E402


def cuda_pair(make_config, reference: str = "sdpa", **overrides):
    attncomp.hf.register("attncomp_cuda", backend="cuda")
    torch.manual_seed(0)
    config = make_config()
    for key, value in overrides.items():
        setattr(config, key, value)
    auto = transformers.AutoModelForSeq2SeqLM if config.is_encoder_decoder else transformers.AutoModelForCausalLM
    ours = auto.from_config(copy.deepcopy(config), attn_implementation="attncomp_cuda")
    theirs = auto.from_config(copy.deepcopy(config), attn_implementation=reference)
    theirs.load_state_dict(ours.state_dict())
    return ours.cuda().eval(), theirs.cuda().eval()


def assert_same_on_cuda(ours, theirs, ids, mask, real) -> None:
    logits, loss, grads = logits_and_grads(ours, ids, mask)
    ref_logits, ref_loss, ref_grads = logits_and_grads(theirs, ids, mask)
    assert logits.is_cuda
    torch.testing.assert_close(logits[real], ref_logits[real], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-4, atol=1e-4)
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-3, atol=1e-4, msg=name)


@pytest.mark.parametrize("make_config", [llama_config, mistral_config, t5_config], ids=["llama", "mistral", "t5"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch_on_cuda_matches_sdpa(make_config, side):
    """T5: its position bias added to the scores on the device, its gradient back to the embedding."""
    ours, theirs = cuda_pair(make_config)
    ids, mask = (x.cuda() for x in padded_batch(side))
    assert_same_on_cuda(ours, theirs, ids, mask, mask.bool())


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_a_4d_mask_on_cuda_matches_sdpa(kind):
    """A caller's 4D mask (two packed sequences a row) as data on the device: tiles classified from
    its block summaries, boolean or float (zeros and the lowest value: read as the boolean it is)."""
    ours, theirs = cuda_pair(llama_config)
    ids = torch.randint(1, VOCAB, (2, T), generator=torch.Generator().manual_seed(3)).cuda()
    mask = packed_4d_mask(kind).cuda()
    assert_same_on_cuda(ours, theirs, ids, mask, torch.ones_like(ids, dtype=torch.bool))


def test_greedy_generate_on_cuda_gives_sdpas_tokens():
    ours, theirs = cuda_pair(llama_config)
    ids, mask = (x.cuda() for x in padded_batch("left", seed=1))
    settings = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(ours.generate(ids, **settings), theirs.generate(ids, **settings))
    assert ids.shape[1] == T


def test_attention_dropout_on_cuda_is_the_eager_attentions_with_the_same_mask(monkeypatch):
    """Training mode with an attention dropout rate: the mask drawn on the device from a seed on the
    device, against transformers' eager attention dropping what ``ac.dropout`` drops."""
    ours, theirs = cuda_pair(llama_config, reference="eager", attention_dropout=0.25)
    ids, mask = (x.cuda() for x in padded_batch("right"))
    logits = assert_same_dropout(ours, theirs, ids, mask, 0.25, monkeypatch, rtol=1e-3, atol=1e-4)
    assert logits.is_cuda
