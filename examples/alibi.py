"""ALiBi: attention with linear biases (Press et al., 2022), causal, with a window.

    s(b, h, i, j) = q_i . k_j / sqrt(D) + slopes[h] * (j - i),   visible if 0 <= i - j < window
    out = softmax(where(visible, s, -inf)) @ v

Each head penalises distance linearly with its own slope; no position
embeddings are needed.  The spec is docs/api.md section 1's example, verbatim.
"""

# Dimension names such as ac.f32["B", "T"] are sizes, not forward references.
# ruff: noqa: F821

import numpy as np

import attncomp as ac


# fmt: off
@ac.spec
def causal_alibi(q: ac.f32["B", "H", "T", "D"],
                 k: ac.f32["B", "H", "S", "D"],
                 v: ac.f32["B", "H", "S", "E"],
                 slopes: ac.f32["H"],
                 *, window: int = 256):              # keyword-only: compile-time constant
    s = (q @ k.mT) * q.shape[-1] ** -0.5             # symbolic dims take part in arithmetic
    b, h, i, j = ac.index(s)                         # absolute positions along each axis of s
    s = s + slopes[h] * (j - i)                      # gather from a captured input
    s = ac.where((j <= i) & (i - j < window), s, -ac.inf)
    return ac.softmax(s, axis=-1) @ v
# fmt: on


def numpy_reference(q, k, v, slopes, *, window: int = 256) -> np.ndarray:
    q, k, v, slopes = (np.asarray(a, dtype=np.float64) for a in (q, k, v, slopes))
    T, S = q.shape[-2], k.shape[-2]
    out = np.zeros(q.shape[:-1] + v.shape[-1:])
    for i in range(T):
        keys = np.arange(max(0, i - window + 1), min(i, S - 1) + 1)
        scores = q[..., i : i + 1, :] @ np.swapaxes(k[..., keys, :], -1, -2) / np.sqrt(q.shape[-1])
        scores = scores + slopes[:, None, None] * (keys - i)  # [H, 1, keys] bias per head
        weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
        weights /= weights.sum(axis=-1, keepdims=True)
        out[..., i, :] = (weights @ v[..., keys, :])[..., 0, :]
    return out


def alibi_slopes(n_heads: int) -> np.ndarray:
    """The paper's geometric slopes 2**(-8h/n) for h = 1..n (n a power of two)."""
    return (2.0 ** (-8.0 * np.arange(1, n_heads + 1) / n_heads)).astype(np.float32)


def make_inputs(rng: np.random.Generator, *, B=1, H=4, T=16, S=16, D=8, E=8) -> list[np.ndarray]:
    q = rng.standard_normal((B, H, T, D), dtype=np.float32)
    k = rng.standard_normal((B, H, S, D), dtype=np.float32)
    v = rng.standard_normal((B, H, S, E), dtype=np.float32)
    return [q, k, v, alibi_slopes(H)]


if __name__ == "__main__":
    from _harness import run_example

    inputs = make_inputs(np.random.default_rng(0), B=2, H=8, T=512, S=512, D=64, E=64)
    run_example(causal_alibi, numpy_reference, inputs)
    run_example(causal_alibi, numpy_reference, inputs, window=64)
