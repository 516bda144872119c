"""Sigmoid attention (FlashSigmoid): each score through a logistic function, no softmax.

    out = where(j <= i, sigmoid(q @ k^T / sqrt(D) - log(S)), 0) @ v

Each weight is its own score's logistic function, not a share of its row's sum, so no row
max or sum is carried.  The bias ``-log(S)`` (the keys' count) keeps the weights' total near
one at the start of training, as softmax's is.  softmax-fusion makes it one ``ac.attention``
with ``normalized = false`` whose score function is ``log sigmoid``: the same tiles, masks
and gradients as softmax attention, nothing of size T x S.
"""

# Dimension names such as ac.f32["B", "T"] are sizes, not forward references.
# ruff: noqa: F821

import numpy as np
from scipy.special import expit

import attncomp as ac


@ac.spec
def causal_sigmoid(q: ac.f32["B", "H", "T", "D"], k: ac.f32["B", "H", "S", "D"], v: ac.f32["B", "H", "S", "E"]):
    scores = (q @ k.mT) * q.shape[-1] ** -0.5 - ac.log(k.shape[-2] * 1.0)
    b, h, i, j = ac.index(scores)
    return ac.where(j <= i, ac.sigmoid(scores), 0.0) @ v


def numpy_reference(q, k, v) -> np.ndarray:
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    T, S = q.shape[-2], k.shape[-2]
    scores = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1]) - np.log(S)
    seen = np.arange(S)[None, :] <= np.arange(T)[:, None]
    return np.where(seen, expit(scores), 0.0) @ v


def make_inputs(rng: np.random.Generator, *, B=1, H=2, T=16, S=16, D=8, E=8) -> list[np.ndarray]:
    q = rng.standard_normal((B, H, T, D), dtype=np.float32)
    k = rng.standard_normal((B, H, S, D), dtype=np.float32)
    v = rng.standard_normal((B, H, S, E), dtype=np.float32)
    return [q, k, v]


if __name__ == "__main__":
    from _harness import run_example

    inputs = make_inputs(np.random.default_rng(0), B=2, H=8, T=512, S=512, D=64, E=64)
    run_example(causal_sigmoid, numpy_reference, inputs)
