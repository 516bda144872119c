"""Key padding: batch entry ``b`` holds ``lengths[b]`` real keys, the rest is padding.

    out = softmax(where(j < lengths[b], q @ k^T / sqrt(D), -inf)) @ v

A batch entry with no real keys (``lengths[b] == 0``) gives zeros, as every
key of its rows is masked.  ``causal_key_padding`` adds ``j <= i``.
"""

# Dimension names such as ac.f32["B", "T"] are sizes, not forward references.
# ruff: noqa: F821

import numpy as np

import attncomp as ac


@ac.spec
def key_padding(
    q: ac.f32["B", "H", "T", "D"],
    k: ac.f32["B", "H", "S", "D"],
    v: ac.f32["B", "H", "S", "E"],
    lengths: ac.i32["B"],
):
    scores = (q @ k.mT) * q.shape[-1] ** -0.5
    b, h, i, j = ac.index(scores)
    is_real_key = j < lengths[b]
    masked = ac.where(is_real_key, scores, -ac.inf)
    return ac.softmax(masked, axis=-1) @ v


@ac.spec
def causal_key_padding(
    q: ac.f32["B", "H", "T", "D"],
    k: ac.f32["B", "H", "S", "D"],
    v: ac.f32["B", "H", "S", "E"],
    lengths: ac.i32["B"],
):
    scores = (q @ k.mT) * q.shape[-1] ** -0.5
    b, h, i, j = ac.index(scores)
    visible = (j <= i) & (j < lengths[b])
    masked = ac.where(visible, scores, -ac.inf)
    return ac.softmax(masked, axis=-1) @ v


def numpy_reference(q, k, v, lengths, *, causal: bool = False) -> np.ndarray:
    """``causal=False`` is ``key_padding``, ``causal=True`` is ``causal_key_padding``."""
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    B, H, T, _ = q.shape
    out = np.zeros((B, H, T, v.shape[-1]))
    for b in range(B):
        for i in range(T):
            last = min(lengths[b], i + 1) if causal else lengths[b]
            if last <= 0:
                continue  # no visible key: the row stays zero
            scores = q[b, :, i : i + 1] @ np.swapaxes(k[b, :, :last], -1, -2) / np.sqrt(q.shape[-1])
            weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
            weights /= weights.sum(axis=-1, keepdims=True)
            out[b, :, i] = (weights @ v[b, :, :last])[:, 0]
    return out


def make_inputs(rng: np.random.Generator, *, B=3, H=2, T=16, S=16, D=8, E=8) -> list[np.ndarray]:
    q = rng.standard_normal((B, H, T, D), dtype=np.float32)
    k = rng.standard_normal((B, H, S, D), dtype=np.float32)
    v = rng.standard_normal((B, H, S, E), dtype=np.float32)
    lengths = rng.integers(1, S + 1, size=B).astype(np.int32)
    lengths[0] = S  # one full-length entry
    if B > 2:
        lengths[-1] = 0  # and one with no keys at all, whose output is zeros
    return [q, k, v, lengths]


if __name__ == "__main__":
    from functools import partial

    from _harness import run_example

    inputs = make_inputs(np.random.default_rng(0), B=4, H=8, T=256, S=512, D=64, E=64)
    print("lengths:", inputs[-1])
    run_example(key_padding, numpy_reference, inputs)
    run_example(causal_key_padding, partial(numpy_reference, causal=True), inputs)
