"""Grouped-query and multi-query attention (Ainslie et al., 2023; Shazeer, 2019), causal.

    g = h // (H / KV),   out_h = softmax(where(j <= i, q_h @ k_g^T / sqrt(D), -inf)) @ v_g

``H`` query heads share ``KV`` key/value heads, ``H / KV`` queries per group:
KV = H is ordinary multi-head attention, KV = 1 is multi-query attention.
``ac.repeat_kv`` repeats each key/value head for its group, as nanochat's
``repeat_kv`` does; the KV cache holds only the ``KV`` heads.
"""

# Dimension names such as ac.f32["B", "T"] are sizes, not forward references.
# ruff: noqa: F821

import numpy as np

import attncomp as ac


@ac.spec
def grouped_query_attention(
    q: ac.f32["B", "H", "T", "D"],
    k: ac.f32["B", "KV", "S", "D"],
    v: ac.f32["B", "KV", "S", "E"],
):
    n_rep = q.shape[1] // k.shape[1]
    k = ac.repeat_kv(k, n_rep)
    v = ac.repeat_kv(v, n_rep)
    scores = (q @ k.mT) * q.shape[-1] ** -0.5
    b, h, i, j = ac.index(scores)
    scores = ac.where(j <= i, scores, -ac.inf)
    return ac.softmax(scores, axis=-1) @ v


@ac.spec
def multi_query_attention(
    q: ac.f32["B", "H", "T", "D"],
    k: ac.f32["B", 1, "S", "D"],
    v: ac.f32["B", 1, "S", "E"],
):
    n_rep = q.shape[1] // k.shape[1]
    k = ac.repeat_kv(k, n_rep)
    v = ac.repeat_kv(v, n_rep)
    scores = (q @ k.mT) * q.shape[-1] ** -0.5
    b, h, i, j = ac.index(scores)
    scores = ac.where(j <= i, scores, -ac.inf)
    return ac.softmax(scores, axis=-1) @ v


def numpy_reference(q, k, v) -> np.ndarray:
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    H, T, S = q.shape[1], q.shape[2], k.shape[2]
    group = H // k.shape[1]
    future = np.arange(S)[None, :] > np.arange(T)[:, None]
    out = np.zeros(q.shape[:-1] + v.shape[-1:])
    for h in range(H):
        kv = h // group  # the shared head of query head h
        scores = q[:, h] @ np.swapaxes(k[:, kv], -1, -2) / np.sqrt(q.shape[-1])
        scores[:, future] = -np.inf
        weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
        weights /= weights.sum(axis=-1, keepdims=True)
        out[:, h] = weights @ v[:, kv]
    return out


def make_inputs(rng: np.random.Generator, *, B=1, H=4, KV=2, T=16, S=16, D=8, E=8) -> list[np.ndarray]:
    q = rng.standard_normal((B, H, T, D), dtype=np.float32)
    k = rng.standard_normal((B, KV, S, D), dtype=np.float32)
    v = rng.standard_normal((B, KV, S, E), dtype=np.float32)
    return [q, k, v]


if __name__ == "__main__":
    from _harness import run_example

    rng = np.random.default_rng(0)
    # Llama-2-70B's grouping: 64 query heads over 8 key/value heads, here 32 over 4
    grouped = make_inputs(rng, B=1, H=32, KV=4, T=512, S=512, D=64, E=64)
    run_example(grouped_query_attention, numpy_reference, grouped)
    single = make_inputs(rng, B=1, H=32, KV=1, T=512, S=512, D=64, E=64)
    run_example(grouped_query_attention, numpy_reference, single)
    run_example(multi_query_attention, numpy_reference, single)
