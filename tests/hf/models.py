"""Tiny random Hugging Face models, each beside a copy with the same weights on ``sdpa`` or ``eager``.

Every model here has head size 16 (so ``scaling`` is 0.25 in all of them, and models share
compiled kernels), 4 query heads over 2 key/value heads where the model groups them, 2 layers,
width 64 and a vocabulary of 100; sliding windows and attention chunks are 4 tokens, so sequences
of 12 cross them.
Nothing is downloaded: models come from configs with random weights.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import attncomp.hf  # noqa: E402

VOCAB, T, WINDOW, CHUNK = 100, 12, 4, 4
IMAGE = VOCAB - 1  # Gemma 3's image token
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)


def llama_config():
    return transformers.LlamaConfig(**SMALL, num_key_value_heads=2, max_position_embeddings=64)


def mistral_config():
    return transformers.MistralConfig(**SMALL, num_key_value_heads=2, head_dim=16, sliding_window=WINDOW)


def gemma2_config():
    # layer 0 slides, layer 1 sees everything; query_pre_attn_scalar = head size gives scaling 0.25
    return transformers.Gemma2Config(
        **SMALL, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW
    )


def gpt2_config():
    # learned absolute positions, no rotary embeddings; no dropout, as attncomp's attention has none
    return transformers.GPT2Config(
        vocab_size=VOCAB,
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=64,
        attn_pdrop=0.0,
        embd_pdrop=0.0,
        resid_pdrop=0.0,
    )


def gpt_oss_config():
    return transformers.GptOssConfig(
        **SMALL, num_key_value_heads=2, head_dim=16, sliding_window=WINDOW, num_local_experts=2, num_experts_per_tok=1
    )


def llama4_config():
    # chunked attention (chunks of 4 tokens) in layer 0, full attention without rotary embeddings in
    # layer 1; a mixture of two experts, queries and keys L2-normed
    return transformers.Llama4TextConfig(
        **SMALL,
        intermediate_size_mlp=128,
        num_key_value_heads=2,
        head_dim=16,
        attention_chunk_size=CHUNK,
        no_rope_layers=[1, 0],
        num_local_experts=2,
        max_position_embeddings=64,
    )


def t5_config():
    # an encoder and a decoder of 2 layers each; learned relative positions in 8 buckets (the first
    # layer's bias, shared by the others: position_bias), no scaling of the scores, no dropout
    return transformers.T5Config(
        vocab_size=VOCAB,
        d_model=64,
        d_kv=16,
        d_ff=128,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        dropout_rate=0.0,
        decoder_start_token_id=0,
    )


def modernbert_config():
    # an encoder: layer 0 global, layer 1 local (a token sees the tokens at most local_attention / 2 = 2
    # positions away, on both sides)
    tokens = dict(pad_token_id=0, bos_token_id=1, cls_token_id=1, eos_token_id=2, sep_token_id=2)
    return transformers.ModernBertConfig(**SMALL, local_attention=WINDOW, global_attn_every_n_layers=2, **tokens)


def gemma3_config():
    """Gemma 3 with a one-layer SigLIP tower: 28 x 28 images become 4 tokens (id 99) that see each
    other both ways; layer 0 slides (transformers overlays the images' blocks on it as mask
    functions evaluated pair by pair), layer 1 sees everything."""
    text = transformers.Gemma3TextConfig(
        **SMALL,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"],
    )
    vision = transformers.SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=7
    )
    return transformers.Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=4,
        image_token_index=IMAGE,
        boi_token_index=IMAGE - 2,
        eoi_token_index=IMAGE - 1,
    )


def model_pair(make_config: Callable, reference: str = "sdpa", seed: int = 0, **overrides):
    """(the model on attncomp, the same weights on ``reference``), in eval mode, float32."""
    attncomp.hf.register()  # attn_implementation="attncomp": the default specs on the cpu backend
    torch.manual_seed(seed)
    config = make_config()
    for key, value in overrides.items():
        setattr(config, key, value)
    auto = transformers.AutoModelForCausalLM
    if config.model_type == "modernbert":
        auto = transformers.AutoModelForMaskedLM
    elif hasattr(config, "vision_config"):
        auto = transformers.AutoModelForImageTextToText
    elif config.is_encoder_decoder:
        auto = transformers.AutoModelForSeq2SeqLM
    ours = auto.from_config(copy.deepcopy(config), attn_implementation="attncomp")
    theirs = auto.from_config(copy.deepcopy(config), attn_implementation=reference)
    theirs.load_state_dict(ours.state_dict())
    assert ours.config._attn_implementation == "attncomp", ours.config._attn_implementation
    assert theirs.config._attn_implementation == reference
    return ours.eval(), theirs.eval()


def padded_batch(side: str, seed: int = 0, lengths=(T, 7, 3)):
    """Token ids and a 2D attention mask: rows of ``lengths`` real tokens padded on ``side``."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (len(lengths), T), generator=generator)
    mask = torch.zeros(len(lengths), T, dtype=torch.long)
    for row, n in enumerate(lengths):
        if side == "left":
            mask[row, T - n :] = 1
        else:
            mask[row, :n] = 1
    return ids, mask


def logits_and_grads(model, ids, mask):
    """The logits and the loss's gradient of every parameter.

    The loss counts real tokens predicted from real tokens: with left padding the first real
    token's prediction comes from a padding position, whose query sees no key at all (attncomp
    and ``sdpa`` give zeros there, ``eager`` an average of padding), so it is left out.
    """
    model.zero_grad(set_to_none=True)
    labels = ids
    if mask is not None and mask.dim() == 2:
        counted = mask.bool()
        counted[:, 1:] &= mask[:, :-1].bool()
        labels = ids.masked_fill(~counted, -100)
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), out.loss.detach(), grads


def assert_same_model_outputs(ours, theirs, ids, mask, rtol: float = 1e-4, atol: float = 1e-5, real=None):
    """Logits at real tokens (``real``, by default where the 2D mask is set), the loss and every
    gradient agree at float32 tolerances."""
    logits, loss, grads = logits_and_grads(ours, ids, mask)
    ref_logits, ref_loss, ref_grads = logits_and_grads(theirs, ids, mask)
    if real is None:
        real = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
    torch.testing.assert_close(logits[real], ref_logits[real], rtol=rtol, atol=atol)
    torch.testing.assert_close(loss, ref_loss, rtol=rtol, atol=atol)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=rtol, atol=atol, msg=name)


def dropout_with_attncomps_law(rate: float, draws: list) -> Callable:
    """A stand-in for ``torch.nn.functional.dropout`` in transformers' eager attention that drops what
    attncomp's ``ac.dropout`` drops: a seed drawn as ``attncomp.hf`` draws it (one ``int64`` from torch's
    CPU generator), each probability kept where ``ac.random(seed, b, h, i, j) >= rate``.  Each call's
    weights' shape is appended to ``draws``."""
    import numpy as np

    from attncomp.ir.ops.random import uniform

    def dropout(weights, p=0.5, training=True, inplace=False):
        assert training and p == rate and weights.dim() == 4
        draws.append(tuple(weights.shape))
        seed = torch.randint(-(2**63), 2**63 - 1, (), dtype=torch.int64)
        keep = uniform(np.int64(seed.item()), *np.ogrid[tuple(slice(n) for n in weights.shape)]) >= rate
        return weights * torch.from_numpy(keep).to(weights.device) / (1 - rate)

    return dropout


def assert_same_dropout(ours, theirs, ids, mask, rate: float, monkeypatch, rtol: float = 1e-4, atol: float = 1e-5):
    """In training mode, ``ours`` and ``theirs`` (on ``eager``, its dropout :func:`dropout_with_attncomps_law`)
    from the same generator state: logits at real tokens, the loss and every gradient agree.  Gives
    ``ours``' logits."""
    ours.train(), theirs.train()
    torch.manual_seed(11)
    logits, loss, grads = logits_and_grads(ours, ids, mask)
    draws: list = []
    with monkeypatch.context() as patch:
        patch.setattr(torch.nn.functional, "dropout", dropout_with_attncomps_law(rate, draws))
        torch.manual_seed(11)
        ref_logits, ref_loss, ref_grads = logits_and_grads(theirs, ids, mask)
    assert len(draws) == ours.config.num_hidden_layers  # one mask a layer
    real = mask.bool()
    torch.testing.assert_close(logits[real], ref_logits[real], rtol=rtol, atol=atol)
    torch.testing.assert_close(loss, ref_loss, rtol=rtol, atol=atol)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=rtol, atol=atol, msg=name)
    return logits
