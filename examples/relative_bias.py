"""Learned relative position bias, clipped (Shaw et al., 2018; T5 without log buckets).

    s(b, h, i, j) = q_i . k_j / sqrt(D) + table[h, clip(i - j, -M, M) + M],   M = max_distance
    out = softmax(s) @ v

Each head learns one bias per relative distance in [-M, M]; farther pairs
share the bias of distance +-M.  ``table`` is [H, R] with R = 2*M + 1.
"""

# Dimension names such as ac.f32["B", "T"] are sizes, not forward references.
# ruff: noqa: F821

import numpy as np

import attncomp as ac


@ac.spec
def relative_bias(
    q: ac.f32["B", "H", "T", "D"],
    k: ac.f32["B", "H", "S", "D"],
    v: ac.f32["B", "H", "S", "E"],
    table: ac.f32["H", "R"],
    *,
    max_distance: int = 16,
):
    scores = (q @ k.mT) * q.shape[-1] ** -0.5
    b, h, i, j = ac.index(scores)
    # clipping keeps every gathered column inside [0, 2*max_distance], which R must cover
    distance = ac.minimum(ac.maximum(i - j, -max_distance), max_distance)
    scores = scores + table[h, distance + max_distance]
    return ac.softmax(scores, axis=-1) @ v


def numpy_reference(q, k, v, table, *, max_distance: int = 16) -> np.ndarray:
    q, k, v, table = (np.asarray(a, dtype=np.float64) for a in (q, k, v, table))
    T, S = q.shape[-2], k.shape[-2]
    bias = np.empty((table.shape[0], T, S))
    for i in range(T):
        for j in range(S):
            bias[:, i, j] = table[:, max_distance + max(-max_distance, min(max_distance, i - j))]
    scores = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1]) + bias
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    weights /= weights.sum(axis=-1, keepdims=True)
    return weights @ v


def make_inputs(rng: np.random.Generator, *, B=1, H=2, T=48, S=48, D=8, E=8, max_distance=16) -> list[np.ndarray]:
    q = rng.standard_normal((B, H, T, D), dtype=np.float32)
    k = rng.standard_normal((B, H, S, D), dtype=np.float32)
    v = rng.standard_normal((B, H, S, E), dtype=np.float32)
    table = rng.standard_normal((H, 2 * max_distance + 1), dtype=np.float32)
    return [q, k, v, table]


if __name__ == "__main__":
    from _harness import run_example

    inputs = make_inputs(np.random.default_rng(0), B=2, H=8, T=512, S=512, D=64, E=64, max_distance=128)
    run_example(relative_bias, numpy_reference, inputs, max_distance=128)
