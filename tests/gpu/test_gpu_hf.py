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
from tests.hf.models import T, llama_config, logits_and_grads, mistral_config, padded_batch  # noqa: E402


def cuda_pair(make_config):
    attncomp.hf.register("attncomp_cuda", backend="cuda")
    torch.manual_seed(0)
    config = make_config()
    ours = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="attncomp_cuda")
    theirs = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa")
    theirs.load_state_dict(ours.state_dict())
    return ours.cuda().eval(), theirs.cuda().eval()


@pytest.mark.parametrize("make_config", [llama_config, mistral_config], ids=["llama", "mistral"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch_on_cuda_matches_sdpa(make_config, side):
    ours, theirs = cuda_pair(make_config)
    ids, mask = (x.cuda() for x in padded_batch(side))
    logits, loss, grads = logits_and_grads(ours, ids, mask)
    ref_logits, ref_loss, ref_grads = logits_and_grads(theirs, ids, mask)
    assert logits.is_cuda
    real = mask.bool()
    torch.testing.assert_close(logits[real], ref_logits[real], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-4, atol=1e-4)
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-3, atol=1e-4, msg=name)


def test_greedy_generate_on_cuda_gives_sdpas_tokens():
    ours, theirs = cuda_pair(llama_config)
    ids, mask = (x.cuda() for x in padded_batch("left", seed=1))
    settings = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(ours.generate(ids, **settings), theirs.generate(ids, **settings))
    assert ids.shape[1] == T
