"""Sliding-window attention: each query sees only the keys near it.

    causal:    visible(i, j) = 0 <= i - j < window      (Mistral, Gemma local layers)
    two-sided: visible(i, j) = |i - j| < window         (Longformer-style local attention)
    out = softmax(where(visible, q @ k^T / sqrt(D), -inf)) @ v

``window`` is a compile-time constant: ``ac.compile(spec, window=4096)``.
"""

# Dimension names such as ac.f32["B", "T"] are sizes, not forward references.
# ruff: noqa: F821

import numpy as np

import attncomp as ac


@ac.spec
def causal_sliding_window(
    q: ac.f32["B", "H", "T", "D"],
    k: ac.f32["B", "H", "S", "D"],
    v: ac.f32["B", "H", "S", "E"],
    *,
    window: int = 256,
):
    scores = (q @ k.mT) * q.shape[-1] ** -0.5
    b, h, i, j = ac.index(scores)
    in_window = (j <= i) & (i - j < window)
    scores = ac.where(in_window, scores, -ac.inf)
    return ac.softmax(scores, axis=-1) @ v


@ac.spec
def two_sided_window(
    q: ac.f32["B", "H", "T", "D"],
    k: ac.f32["B", "H", "S", "D"],
    v: ac.f32["B", "H", "S", "E"],
    *,
    window: int = 256,
):
    scores = (q @ k.mT) * q.shape[-1] ** -0.5
    b, h, i, j = ac.index(scores)
    in_window = ac.abs(i - j) < window
    scores = ac.where(in_window, scores, -ac.inf)
    return ac.softmax(scores, axis=-1) @ v


def numpy_reference(q, k, v, *, window: int = 256, causal: bool = True) -> np.ndarray:
    """``causal=True`` is ``causal_sliding_window``, ``causal=False`` is ``two_sided_window``."""
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    T, S = q.shape[-2], k.shape[-2]
    out = np.zeros(q.shape[:-1] + v.shape[-1:])
    for i in range(T):
        first = max(0, i - window + 1)
        last = i if causal else i + window - 1  # inclusive
        keys = slice(first, min(last, S - 1) + 1)
        if keys.start >= keys.stop:
            continue  # no key in reach: the row stays zero
        scores = q[..., i : i + 1, :] @ np.swapaxes(k[..., keys, :], -1, -2) / np.sqrt(q.shape[-1])
        weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
        weights /= weights.sum(axis=-1, keepdims=True)
        out[..., i, :] = (weights @ v[..., keys, :])[..., 0, :]
    return out


def make_inputs(rng: np.random.Generator, *, B=1, H=2, T=16, S=16, D=8, E=8) -> list[np.ndarray]:
    q = rng.standard_normal((B, H, T, D), dtype=np.float32)
    k = rng.standard_normal((B, H, S, D), dtype=np.float32)
    v = rng.standard_normal((B, H, S, E), dtype=np.float32)
    return [q, k, v]


if __name__ == "__main__":
    from functools import partial

    from _harness import run_example

    inputs = make_inputs(np.random.default_rng(0), B=2, H=8, T=1024, S=1024, D=64, E=64)
    run_example(causal_sliding_window, numpy_reference, inputs)
    run_example(causal_sliding_window, numpy_reference, inputs, window=64)
    run_example(two_sided_window, partial(numpy_reference, causal=False), inputs, window=128)
