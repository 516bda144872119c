"""A Hugging Face GPT-2 whose attention is ALiBi, written as a spec (needs the hf extra).

    python examples/hf_alibi.py        # trains a tiny GPT-2 to copy, then generates with it

GPT-2 has learned absolute positions and no relative bias. ``attncomp.hf.register("alibi",
spec=...)`` gives it one without touching its code: every attention layer runs the spec below,
with learnable per-head slopes that the example attaches to each attention module as
``slopes`` (a spec argument that is not a fact of the mask is read from the module by name),
so they train with the rest of the model.

The spec takes the facts attncomp's mask function hands over (docs/api.md section 10):
``shift`` places the queries among the keys (a cache of earlier tokens during ``generate``),
``q_doc`` and ``k_doc`` hide padding from ``attention_mask``. ``scale`` is the layer's
``scaling``. ``numpy_reference`` spells the same attention without the DSL; the gallery's
tests check the spec against it.

The task is train_tiny_lm.py's: random tokens followed by themselves, the loss taken on the
copy. After training, ``generate`` continues a fresh prompt of random tokens (left-padded
beside a shorter one, as batched generation pads) and the script prints how many of the
copied tokens are right.
"""

# Dimension names such as ac.f32["B", "T"] are sizes, not forward references.
# ruff: noqa: F821

import math

import numpy as np

import attncomp as ac


@ac.spec
def hf_alibi(
    q: ac.floating["B", "H", "T", "D"],
    k: ac.floating["B", "H", "S", "D"],
    v: ac.floating["B", "H", "S", "E"],
    shift: ac.i32["B"],
    q_doc: ac.i32["B", "T"],
    k_doc: ac.i32["B", "S"],
    slopes: ac.floating["H"],
    *,
    scale: float = 1.0,
):
    """Causal ALiBi over HF's arguments: ``s + slopes[h] * (j - position)``, padding hidden."""
    s = (q @ k.mT) * scale
    b, h, i, j = ac.index(s)
    position = i + shift[b]  # the query's position among the keys
    s = s + slopes[h] * (j - position)
    s = ac.where((j <= position) & (q_doc[b, i] == k_doc[b, j]), s, -ac.inf)
    return ac.softmax(s, axis=-1) @ v


def alibi_spec() -> ac.Spec:
    """The spec ``attncomp.hf.register`` takes."""
    return hf_alibi


def numpy_reference(q, k, v, shift, q_doc, k_doc, slopes, *, scale: float = 1.0) -> np.ndarray:
    q, k, v, slopes = (np.asarray(a, dtype=np.float64) for a in (q, k, v, slopes))
    B, H, T, _ = q.shape
    S = k.shape[2]
    out = np.zeros((B, H, T, v.shape[-1]))
    j = np.arange(S)
    for b in range(B):
        for i in range(T):
            position = i + shift[b]
            keys = j[(j <= position) & (k_doc[b] == q_doc[b, i])]
            scores = q[b, :, i, None, :] @ k[b][:, keys, :].swapaxes(-1, -2) * scale  # [H, 1, keys]
            scores = scores + slopes[:, None, None] * (keys - position)
            weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
            weights /= weights.sum(axis=-1, keepdims=True)
            out[b, :, i, :] = (weights @ v[b][:, keys, :])[:, 0, :]
    return out


def make_inputs(rng: np.random.Generator, *, B=2, H=4, T=12, S=16, D=8, E=8) -> list[np.ndarray]:
    """T new tokens after S - T cached ones; the second sequence has three tokens of left padding."""
    q = rng.standard_normal((B, H, T, D), dtype=np.float32)
    k = rng.standard_normal((B, H, S, D), dtype=np.float32)
    v = rng.standard_normal((B, H, S, E), dtype=np.float32)
    shift = np.full(B, S - T, dtype=np.int32)
    k_doc = np.ones((B, S), dtype=np.int32)
    k_doc[B - 1, :3] = 0  # padding: a document of its own
    q_doc = k_doc[:, S - T :].copy()
    slopes = np.asarray(alibi_slopes(H), dtype=np.float32)
    return [q, k, v, shift, q_doc, k_doc, slopes]


def alibi_slopes(heads: int) -> list[float]:
    """ALiBi's geometric slopes (Press et al., 2022): 2^(-8/heads), 2^(-16/heads), ..."""
    return [2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)]


def build_model(vocab: int = 16, width: int = 64, heads: int = 4, layers: int = 2, seed: int = 0):
    """A tiny GPT-2 on the ``alibi`` attention, learnable slopes on every attention module."""
    import torch
    from transformers import AutoModelForCausalLM, GPT2Config

    import attncomp.hf

    attncomp.hf.register("alibi", spec=alibi_spec(), backend="cpu")
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=vocab,
        n_embd=width,
        n_layer=layers,
        n_head=heads,
        n_positions=64,
        attn_pdrop=0.0,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
    )
    model = AutoModelForCausalLM.from_config(config, attn_implementation="alibi")
    for block in model.transformer.h:
        block.attn.slopes = torch.nn.Parameter(torch.tensor(alibi_slopes(heads)))
    return model


def copy_batch(rng: np.random.Generator, batch: int, half: int, vocab: int) -> np.ndarray:
    first = rng.integers(1, vocab, (batch, half))
    return np.concatenate([first, first], axis=1)


def train(model, steps: int, *, batch: int = 16, half: int = 8, vocab: int = 16, seed: int = 0) -> list[float]:
    """Adam on the copying task; the losses of the copied half, one per step."""
    import torch

    rng = np.random.default_rng(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    model.train()
    for _ in range(steps):
        tokens = torch.from_numpy(copy_batch(rng, batch, half, vocab))
        labels = tokens.clone()
        labels[:, :half] = -100  # the first half is random: only the copy can be learned
        loss = model(input_ids=tokens, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def generate_copies(model, *, half: int = 8, vocab: int = 16, seed: int = 1) -> tuple[int, int]:
    """Greedy ``generate`` on two prompts (one left-padded); (copied tokens right, tokens)."""
    import torch

    rng = np.random.default_rng(seed)
    first = torch.from_numpy(rng.integers(1, vocab, (2, half)))
    prompts = torch.zeros(2, half + 2, dtype=torch.long)
    mask = torch.zeros_like(prompts)
    prompts[0, 2:], mask[0, 2:] = first[0], 1  # two tokens of padding on the left
    prompts[1, :], mask[1, :] = torch.cat([first[1], first[1, :2]]), 1  # already copying
    model.eval()
    with torch.no_grad():
        out = model.generate(prompts, attention_mask=mask, max_new_tokens=half - 2, do_sample=False, pad_token_id=0)
    expected = torch.stack([first[0, : half - 2], first[1, 2:]])
    return int((out[:, half + 2 :] == expected).sum()), expected.numel()


if __name__ == "__main__":
    steps = 300
    model = build_model()
    losses = train(model, steps)
    print(f"loss of the copy: {losses[0]:.3f} at step 1, {losses[-1]:.3f} at step {steps}")
    print(f"(a model that guesses uniformly among 15 tokens: {math.log(15):.3f})")
    slopes = model.transformer.h[0].attn.slopes.detach().numpy()
    print("layer 0 slopes, learned:", np.array2string(slopes, precision=3))
    right, total = generate_copies(model)
    print(f"generate (greedy, left padding): {right} of {total} copied tokens right")
