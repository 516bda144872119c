"""Cross-attention: decoder positions query an encoder's memory (T != S).

    out = softmax((x W_q)(m W_k)^T / sqrt(D)) (m W_v), per head, then W_o

Queries come from the decoder states ``x`` [B, T, C], keys and values from
the encoder output ``memory`` [B, S, C].  No mask: decoder and encoder
positions are different sequences, so "earlier" has no meaning between them.
"""

# Dimension names such as ac.f32["B", "T"] are sizes, not forward references.
# ruff: noqa: F821

import numpy as np

import attncomp as ac


@ac.spec
def cross_attention(
    x: ac.f32["B", "T", "C"],
    memory: ac.f32["B", "S", "C"],
    w_q: ac.f32["C", "C"],
    w_k: ac.f32["C", "C"],
    w_v: ac.f32["C", "C"],
    w_o: ac.f32["C", "C"],
    *,
    n_head: int = 4,
):
    B, T, C = x.shape
    S = memory.shape[1]
    head_dim = C // n_head
    q = (x @ w_q).reshape(B, T, n_head, head_dim).transpose(1, 2)
    k = (memory @ w_k).reshape(B, S, n_head, head_dim).transpose(1, 2)
    v = (memory @ w_v).reshape(B, S, n_head, head_dim).transpose(1, 2)
    scores = (q @ k.mT) * head_dim**-0.5
    y = ac.softmax(scores, axis=-1) @ v
    y = y.transpose(1, 2).reshape(B, T, C)
    return y @ w_o


def numpy_reference(x, memory, w_q, w_k, w_v, w_o, *, n_head: int = 4) -> np.ndarray:
    x, memory, w_q, w_k, w_v, w_o = (np.asarray(a, dtype=np.float64) for a in (x, memory, w_q, w_k, w_v, w_o))
    B, T, C = x.shape
    head_dim = C // n_head
    out = np.zeros((B, T, C))
    for h in range(n_head):
        cols = slice(h * head_dim, (h + 1) * head_dim)  # head h owns these columns
        q, k, v = x @ w_q[:, cols], memory @ w_k[:, cols], memory @ w_v[:, cols]
        scores = np.einsum("btd,bsd->bts", q, k) / np.sqrt(head_dim)
        weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
        weights /= weights.sum(axis=-1, keepdims=True)
        out += (weights @ v) @ w_o[cols, :]
    return out


def make_inputs(rng: np.random.Generator, *, B=1, T=12, S=20, C=16) -> list[np.ndarray]:
    x = rng.standard_normal((B, T, C), dtype=np.float32)
    memory = rng.standard_normal((B, S, C), dtype=np.float32)
    # 1/sqrt(C) keeps the projected activations at unit scale
    weights = [(rng.standard_normal((C, C)) / np.sqrt(C)).astype(np.float32) for _ in range(4)]
    return [x, memory, *weights]


if __name__ == "__main__":
    from _harness import run_example

    inputs = make_inputs(np.random.default_rng(0), B=2, T=128, S=768, C=512)
    run_example(cross_attention, numpy_reference, inputs, n_head=8)
