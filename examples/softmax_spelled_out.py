"""Causal attention with the softmax written out by hand, next to the same with ``ac.softmax``.

    m = max_j s_ij,   e_ij = exp(s_ij - m),   p_ij = e_ij / sum_j e_ij,   out = p @ v

Subtracting the row maximum keeps ``exp`` from overflowing and does not
change the result.  Both spellings mean the same thing and compile to the
same fused kernel.
"""

# Dimension names such as ac.f32["B", "T"] are sizes, not forward references.
# ruff: noqa: F821

import numpy as np

import attncomp as ac


@ac.spec
def causal_softmax_spelled_out(
    q: ac.f32["B", "H", "T", "D"],
    k: ac.f32["B", "H", "S", "D"],
    v: ac.f32["B", "H", "S", "E"],
):
    s = (q @ k.mT) * q.shape[-1] ** -0.5
    b, h, i, j = ac.index(s)
    s = ac.where(j <= i, s, -ac.inf)
    e = ac.exp(s - ac.max(s, -1, keepdims=True))
    p = e / ac.sum(e, -1, keepdims=True)
    return p @ v


@ac.spec
def causal_softmax_builtin(
    q: ac.f32["B", "H", "T", "D"],
    k: ac.f32["B", "H", "S", "D"],
    v: ac.f32["B", "H", "S", "E"],
):
    s = (q @ k.mT) * q.shape[-1] ** -0.5
    b, h, i, j = ac.index(s)
    s = ac.where(j <= i, s, -ac.inf)
    p = ac.softmax(s, axis=-1)
    return p @ v


def numpy_reference(q, k, v) -> np.ndarray:
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    T, S = q.shape[-2], k.shape[-2]
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    s = np.where(np.arange(S)[None, :] <= np.arange(T)[:, None], s, -np.inf)
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    return (e / e.sum(axis=-1, keepdims=True)) @ v


def make_inputs(rng: np.random.Generator, *, B=1, H=2, T=16, S=16, D=8, E=8) -> list[np.ndarray]:
    q = rng.standard_normal((B, H, T, D), dtype=np.float32)
    k = rng.standard_normal((B, H, S, D), dtype=np.float32)
    v = rng.standard_normal((B, H, S, E), dtype=np.float32)
    return [q, k, v]


if __name__ == "__main__":
    from _harness import run_example

    inputs = make_inputs(np.random.default_rng(0), B=2, H=8, T=512, S=512, D=64, E=64)
    run_example(causal_softmax_spelled_out, numpy_reference, inputs)
    run_example(causal_softmax_builtin, numpy_reference, inputs)
