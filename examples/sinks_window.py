"""Attention sinks with a sliding window (StreamingLLM, Xiao et al., 2023).

    visible(i, j) = j <= i  and  (i - j < window  or  j < sinks)
    out = softmax(where(visible, q @ k^T / sqrt(D), -inf)) @ v

The first ``sinks`` tokens stay visible to every later query, however far
back they are: models park attention mass there, and dropping them from a
pure window degrades generation.
"""

# Dimension names such as ac.f32["B", "T"] are sizes, not forward references.
# ruff: noqa: F821

import numpy as np

import attncomp as ac


@ac.spec
def sinks_window(
    q: ac.f32["B", "H", "T", "D"],
    k: ac.f32["B", "H", "S", "D"],
    v: ac.f32["B", "H", "S", "E"],
    *,
    window: int = 256,
    sinks: int = 4,
):
    scores = (q @ k.mT) * q.shape[-1] ** -0.5
    b, h, i, j = ac.index(scores)
    visible = (j <= i) & ((i - j < window) | (j < sinks))
    scores = ac.where(visible, scores, -ac.inf)
    return ac.softmax(scores, axis=-1) @ v


def numpy_reference(q, k, v, *, window: int = 256, sinks: int = 4) -> np.ndarray:
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    T, S = q.shape[-2], k.shape[-2]
    out = np.zeros(q.shape[:-1] + v.shape[-1:])
    for i in range(T):
        recent = range(max(0, i - window + 1), min(i, S - 1) + 1)
        keys = sorted(set(range(min(sinks, i + 1, S))) | set(recent))
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
    from _harness import run_example

    inputs = make_inputs(np.random.default_rng(0), B=2, H=8, T=1024, S=1024, D=64, E=64)
    run_example(sinks_window, numpy_reference, inputs)
    run_example(sinks_window, numpy_reference, inputs, window=32, sinks=1)
