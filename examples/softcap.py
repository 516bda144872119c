"""Logit soft-capping (Gemma 2): squash the scores smoothly into (-cap, cap) before the softmax.

    s = cap * tanh((q @ k^T / sqrt(D)) / cap),   out = softmax(where(j <= i, s, -inf)) @ v

Near zero the cap changes nothing (tanh(x) ~ x); it only bounds runaway
logits, which keeps the softmax from saturating.  Gemma 2 uses ``cap = 50``.
"""

# Dimension names such as ac.f32["B", "T"] are sizes, not forward references.
# ruff: noqa: F821

import numpy as np

import attncomp as ac


@ac.spec
def causal_softcap(
    q: ac.f32["B", "H", "T", "D"],
    k: ac.f32["B", "H", "S", "D"],
    v: ac.f32["B", "H", "S", "E"],
    *,
    cap: float = 50.0,
):
    scores = (q @ k.mT) * q.shape[-1] ** -0.5
    scores = cap * ac.tanh(scores / cap)
    b, h, i, j = ac.index(scores)
    scores = ac.where(j <= i, scores, -ac.inf)
    return ac.softmax(scores, axis=-1) @ v


def numpy_reference(q, k, v, *, cap: float = 50.0) -> np.ndarray:
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    T, S = q.shape[-2], k.shape[-2]
    scores = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    scores = cap * np.tanh(scores / cap)
    future = np.arange(S)[None, :] > np.arange(T)[:, None]
    scores[..., future] = -np.inf
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    weights /= weights.sum(axis=-1, keepdims=True)
    return weights @ v


def make_inputs(rng: np.random.Generator, *, B=1, H=2, T=16, S=16, D=8, E=8) -> list[np.ndarray]:
    q = rng.standard_normal((B, H, T, D), dtype=np.float32)
    k = rng.standard_normal((B, H, S, D), dtype=np.float32)
    v = rng.standard_normal((B, H, S, E), dtype=np.float32)
    return [q, k, v]


if __name__ == "__main__":
    from _harness import run_example

    inputs = make_inputs(np.random.default_rng(0), B=2, H=8, T=512, S=512, D=64, E=64)
    run_example(causal_softcap, numpy_reference, inputs)
    # unit-variance logits barely reach 50; a cap of 1 visibly reshapes them
    run_example(causal_softcap, numpy_reference, inputs, cap=1.0)
