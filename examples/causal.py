"""Causal (autoregressive) attention: query ``i`` sees keys ``j <= i``.

    out = softmax(where(j <= i, q @ k^T / sqrt(D), -inf)) @ v

Positions are absolute, so with a KV cache the new queries sit after the
cached keys and the same spec decodes unchanged.
"""

# Dimension names such as ac.f32["B", "T"] are sizes, not forward references.
# ruff: noqa: F821

import numpy as np

import attncomp as ac


@ac.spec
def causal(
    q: ac.f32["B", "H", "T", "D"],
    k: ac.f32["B", "H", "S", "D"],
    v: ac.f32["B", "H", "S", "E"],
):
    scores = (q @ k.mT) * q.shape[-1] ** -0.5
    b, h, i, j = ac.index(scores)
    masked = ac.where(j <= i, scores, -ac.inf)
    return ac.softmax(masked, axis=-1) @ v


def numpy_reference(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    T, S = q.shape[-2], k.shape[-2]
    out = np.zeros(q.shape[:-1] + v.shape[-1:])
    for i in range(T):
        keys = slice(0, min(i, S - 1) + 1)  # row i sees keys 0..i
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

    inputs = make_inputs(np.random.default_rng(0), B=2, H=8, T=512, S=512, D=64, E=64)
    run_example(causal, numpy_reference, inputs)
