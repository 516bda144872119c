"""Attention that also returns the log-sum-exp of each score row, as flash-attention kernels do.

    lse_i = log(sum_j exp(s_ij)),   out = softmax(s) @ v = sum_j exp(s_ij - lse_i) v_j

The LSE (natural log) is what a backward pass or a merge of partial
attentions (split-KV decoding, ring attention) needs to recombine outputs.
A row with every key masked gives zeros and an LSE of -inf.
"""

# Dimension names such as ac.f32["B", "T"] are sizes, not forward references.
# ruff: noqa: F821

import numpy as np

import attncomp as ac


@ac.spec
def causal_with_lse(
    q: ac.f32["B", "H", "T", "D"],
    k: ac.f32["B", "H", "S", "D"],
    v: ac.f32["B", "H", "S", "E"],
):
    scores = (q @ k.mT) * q.shape[-1] ** -0.5
    b, h, i, j = ac.index(scores)
    scores = ac.where(j <= i, scores, -ac.inf)
    out = ac.softmax(scores, axis=-1) @ v
    lse = ac.logsumexp(scores, axis=-1)
    return out, lse


@ac.spec
def key_padding_with_lse(
    q: ac.f32["B", "H", "T", "D"],
    k: ac.f32["B", "H", "S", "D"],
    v: ac.f32["B", "H", "S", "E"],
    lengths: ac.i32["B"],
):
    scores = (q @ k.mT) * q.shape[-1] ** -0.5
    b, h, i, j = ac.index(scores)
    scores = ac.where(j < lengths[b], scores, -ac.inf)
    out = ac.softmax(scores, axis=-1) @ v
    lse = ac.logsumexp(scores, axis=-1)
    return out, lse


def numpy_reference(q, k, v, lengths=None) -> tuple[np.ndarray, np.ndarray]:
    """Causal without ``lengths`` (``causal_with_lse``); key padding with them."""
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    B, H, T, _ = q.shape
    S = k.shape[2]
    out = np.zeros((B, H, T, v.shape[-1]))
    lse = np.full((B, H, T), -np.inf)
    for b in range(B):
        for i in range(T):
            seen = min(i + 1, S) if lengths is None else int(lengths[b])
            if seen == 0:
                continue  # no visible key: zeros and -inf
            scores = np.einsum("hd,hsd->hs", q[b, :, i], k[b, :, :seen]) / np.sqrt(q.shape[-1])
            peak = scores.max(axis=-1, keepdims=True)
            total = np.exp(scores - peak).sum(axis=-1)
            lse[b, :, i] = peak[:, 0] + np.log(total)
            weights = np.exp(scores - lse[b, :, i, None])  # softmax through the LSE
            out[b, :, i] = np.einsum("hs,hse->he", weights, v[b, :, :seen])
    return out, lse


def make_inputs(rng: np.random.Generator, *, B=1, H=2, T=16, S=16, D=8, E=8) -> list[np.ndarray]:
    """Inputs of ``causal_with_lse``; append lengths for ``key_padding_with_lse``."""
    q = rng.standard_normal((B, H, T, D), dtype=np.float32)
    k = rng.standard_normal((B, H, S, D), dtype=np.float32)
    v = rng.standard_normal((B, H, S, E), dtype=np.float32)
    return [q, k, v]


if __name__ == "__main__":
    from _harness import run_example

    inputs = make_inputs(np.random.default_rng(0), B=2, H=8, T=512, S=512, D=64, E=64)
    run_example(causal_with_lse, numpy_reference, inputs)
    lengths = np.array([300, 0], dtype=np.int32)  # the second entry is all padding
    run_example(key_padding_with_lse, numpy_reference, [*inputs, lengths])
