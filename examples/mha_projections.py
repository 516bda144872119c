"""Multi-head causal self-attention from hidden states, GPT-2 style.

    q, k, v = split(x @ W_qkv);  y = causal_attention(heads(q), heads(k), heads(v));  out = merge(y) @ W_o

One fused projection ``x @ w_qkv`` (GPT-2's ``c_attn``) is sliced into q, k
and v, each viewed as ``n_head`` heads of ``C // n_head`` channels and moved to
[B, heads, T, head_dim]; after causal attention the heads are merged back to
[B, T, C] and projected (``c_proj``).  GPT-2's biases would be one ``+ b`` each.
"""

# Dimension names such as ac.f32["B", "T"] are sizes, not forward references.
# ruff: noqa: F821

import numpy as np

import attncomp as ac


@ac.spec
def gpt2_attention(
    x: ac.f32["B", "T", "C"],
    w_qkv: ac.f32["C", "C3"],  # C3 = 3*C: an annotation names a size, it cannot compute one
    w_proj: ac.f32["C", "C"],
    *,
    n_head: int = 12,
):
    B, T, C = x.shape
    head_dim = C // n_head
    qkv = x @ w_qkv
    q = qkv[..., :C].reshape(B, T, n_head, head_dim).transpose(1, 2)
    k = qkv[..., C : 2 * C].reshape(B, T, n_head, head_dim).transpose(1, 2)
    # "2*C:" (not "2*C:3*C") so the reshape checks at call time that C3 is 3*C
    v = qkv[..., 2 * C :].reshape(B, T, n_head, head_dim).transpose(1, 2)
    scores = (q @ k.mT) * head_dim**-0.5
    b, h, i, j = ac.index(scores)
    scores = ac.where(j <= i, scores, -ac.inf)
    y = ac.softmax(scores, axis=-1) @ v
    y = y.transpose(1, 2).reshape(B, T, C)
    return y @ w_proj


def numpy_reference(x, w_qkv, w_proj, *, n_head: int = 12) -> np.ndarray:
    x, w_qkv, w_proj = (np.asarray(a, dtype=np.float64) for a in (x, w_qkv, w_proj))
    B, T, C = x.shape
    head_dim = C // n_head
    future = np.triu(np.ones((T, T), dtype=bool), k=1)
    out = np.zeros((B, T, C))
    for h in range(n_head):
        cols = np.arange(h * head_dim, (h + 1) * head_dim)  # head h's channels within q, k and v
        q, k, v = (x @ w_qkv[:, part * C + cols] for part in range(3))
        scores = q @ np.swapaxes(k, 1, 2) / np.sqrt(head_dim)
        scores[:, future] = -np.inf
        weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
        weights /= weights.sum(axis=-1, keepdims=True)
        out += (weights @ v) @ w_proj[cols, :]
    return out


def make_inputs(rng: np.random.Generator, *, B=1, T=16, C=24) -> list[np.ndarray]:
    x = rng.standard_normal((B, T, C), dtype=np.float32)
    # 1/sqrt(C) keeps the projected activations at unit scale
    w_qkv = (rng.standard_normal((C, 3 * C)) / np.sqrt(C)).astype(np.float32)
    w_proj = (rng.standard_normal((C, C)) / np.sqrt(C)).astype(np.float32)
    return [x, w_qkv, w_proj]


if __name__ == "__main__":
    from _harness import run_example

    # GPT-2 small: 768 channels in 12 heads of 64
    inputs = make_inputs(np.random.default_rng(0), B=2, T=512, C=768)
    run_example(gpt2_attention, numpy_reference, inputs)
