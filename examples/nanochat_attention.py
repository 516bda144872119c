"""nanochat's causal self-attention layer (``CausalSelfAttention.forward``) as one spec.

    q, k, v = heads(x W_q), heads(x W_k), heads(x W_v)
    q, k = norm(rope(q)), norm(rope(k));   k, v = repeat_kv(k), repeat_kv(v)
    out = merge(softmax(where(j <= i, q k^T / sqrt(D), -inf)) v) W_o

From hidden states ``x`` [B, T, C]: bias-free projections to ``n_head`` query
heads and ``n_kv_head`` key/value heads of ``D = HD / n_head`` channels,
rotary embeddings, RMS norm of queries and keys, grouped-query attention,
causal softmax attention, then the heads merged and projected back to C.
The rotary and norm helpers are those of ``rope_qknorm.py``.
"""

# Dimension names such as ac.f32["B", "T"] are sizes, not forward references.
# ruff: noqa: F821

import sys
from pathlib import Path

import numpy as np

import attncomp as ac

sys.path.insert(0, str(Path(__file__).resolve().parent))  # rope_qknorm.py sits next to this file
from rope_qknorm import apply_rotary_emb, numpy_rms_norm, numpy_rotary, rms_norm  # noqa: E402


@ac.spec
def nanochat_attention(
    x: ac.f32["B", "T", "C"],
    w_q: ac.f32["C", "HD"],  # HD = n_head * head_dim
    w_k: ac.f32["C", "KVD"],  # KVD = n_kv_head * head_dim
    w_v: ac.f32["C", "KVD"],
    w_o: ac.f32["HD", "C"],
    *,
    n_head: int = 6,
    n_kv_head: int = 6,
    base: float = 10000.0,
    eps: float = 2.0**-23,  # float32 machine epsilon, torch's rms_norm default
):
    B, T, C = x.shape
    head_dim = w_q.shape[1] // n_head
    # [B, T, heads, D] as in nanochat, then heads forward: rotary and norm act on
    # each (token, head) vector alone, so doing them after the transpose is the same
    q = (x @ w_q).reshape(B, T, n_head, head_dim).transpose(1, 2)
    k = (x @ w_k).reshape(B, T, n_kv_head, head_dim).transpose(1, 2)
    v = (x @ w_v).reshape(B, T, n_kv_head, head_dim).transpose(1, 2)
    q, k = apply_rotary_emb(q, base), apply_rotary_emb(k, base)
    q, k = rms_norm(q, eps), rms_norm(k, eps)
    n_rep = n_head // n_kv_head
    k, v = ac.repeat_kv(k, n_rep), ac.repeat_kv(v, n_rep)
    scores = (q @ k.mT) * head_dim**-0.5
    b, h, i, j = ac.index(scores)
    scores = ac.where(j <= i, scores, -ac.inf)
    y = ac.softmax(scores, axis=-1) @ v
    y = y.transpose(1, 2).reshape(B, T, n_head * head_dim)
    return y @ w_o


def numpy_reference(x, w_q, w_k, w_v, w_o, *, n_head=6, n_kv_head=6, base=10000.0, eps=2.0**-23) -> np.ndarray:
    x, w_q, w_k, w_v, w_o = (np.asarray(a, dtype=np.float64) for a in (x, w_q, w_k, w_v, w_o))
    B, T, C = x.shape
    head_dim = w_q.shape[1] // n_head

    def heads(projected: np.ndarray, n: int) -> np.ndarray:  # [B, T, n*D] -> [B, n, T, D]
        return projected.reshape(B, T, n, head_dim).transpose(0, 2, 1, 3)

    q = numpy_rms_norm(numpy_rotary(heads(x @ w_q, n_head), base), eps)
    k = numpy_rms_norm(numpy_rotary(heads(x @ w_k, n_kv_head), base), eps)
    v = heads(x @ w_v, n_kv_head)
    future = np.triu(np.ones((T, T), dtype=bool), k=1)
    y = np.zeros((B, T, n_head * head_dim))
    for h in range(n_head):
        kv = h // (n_head // n_kv_head)  # the key/value head query head h shares
        scores = q[:, h] @ np.swapaxes(k[:, kv], -1, -2) / np.sqrt(head_dim)
        scores[:, future] = -np.inf
        weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
        weights /= weights.sum(axis=-1, keepdims=True)
        y[:, :, h * head_dim : (h + 1) * head_dim] = weights @ v[:, kv]
    return y @ w_o


def make_inputs(rng: np.random.Generator, *, B=1, T=16, C=24, n_head=6, n_kv_head=6) -> list[np.ndarray]:
    head_dim = C // n_head

    def weight(rows: int, cols: int) -> np.ndarray:
        # 1/sqrt(rows) keeps the projected activations at unit scale
        return (rng.standard_normal((rows, cols)) / np.sqrt(rows)).astype(np.float32)

    x = rng.standard_normal((B, T, C), dtype=np.float32)
    kv_width = n_kv_head * head_dim
    return [x, weight(C, C), weight(C, kv_width), weight(C, kv_width), weight(C, C)]


if __name__ == "__main__":
    from _harness import run_example

    rng = np.random.default_rng(0)
    # nanochat's example width: 768 channels in 6 heads of 128
    run_example(nanochat_attention, numpy_reference, make_inputs(rng, B=2, T=512, C=768))
    grouped = make_inputs(rng, B=2, T=512, C=768, n_head=6, n_kv_head=2)
    run_example(nanochat_attention, numpy_reference, grouped, n_kv_head=2)
