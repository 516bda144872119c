"""Prefix-LM attention: bidirectional over a prompt prefix, causal after it (T5 prefix LM, UniLM).

    visible(b, i, j) = j <= i  or  j < prefix[b]
    out = softmax(where(visible, q @ k^T / sqrt(D), -inf)) @ v

``prefix[b]`` is the prefix length of batch entry ``b``: every query sees the
whole prefix, and the tokens after it see only what precedes them.
"""

# Dimension names such as ac.f32["B", "T"] are sizes, not forward references.
# ruff: noqa: F821

import numpy as np

import attncomp as ac


@ac.spec
def prefix_lm(
    q: ac.f32["B", "H", "T", "D"],
    k: ac.f32["B", "H", "S", "D"],
    v: ac.f32["B", "H", "S", "E"],
    prefix: ac.i32["B"],
):
    scores = (q @ k.mT) * q.shape[-1] ** -0.5
    b, h, i, j = ac.index(scores)
    visible = (j <= i) | (j < prefix[b])
    scores = ac.where(visible, scores, -ac.inf)
    return ac.softmax(scores, axis=-1) @ v


def numpy_reference(q, k, v, prefix) -> np.ndarray:
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    B, H, T, _ = q.shape
    S = k.shape[-2]
    out = np.zeros((B, H, T, v.shape[-1]))
    for b in range(B):
        for i in range(T):
            seen = min(S, max(i + 1, int(prefix[b])))  # keys 0 .. seen-1
            scores = q[b, :, i : i + 1] @ np.swapaxes(k[b, :, :seen], -1, -2) / np.sqrt(q.shape[-1])
            weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
            weights /= weights.sum(axis=-1, keepdims=True)
            out[b, :, i] = (weights @ v[b, :, :seen])[:, 0]
    return out


def make_inputs(rng: np.random.Generator, *, B=2, H=2, T=16, S=16, D=8, E=8) -> list[np.ndarray]:
    q = rng.standard_normal((B, H, T, D), dtype=np.float32)
    k = rng.standard_normal((B, H, S, D), dtype=np.float32)
    v = rng.standard_normal((B, H, S, E), dtype=np.float32)
    prefix = rng.integers(0, S + 1, size=B).astype(np.int32)
    prefix[0] = 0  # no prefix: plain causal attention
    return [q, k, v, prefix]


if __name__ == "__main__":
    from _harness import run_example

    inputs = make_inputs(np.random.default_rng(0), B=4, H=8, T=512, S=512, D=64, E=64)
    print("prefix:", inputs[-1])
    run_example(prefix_lm, numpy_reference, inputs)
