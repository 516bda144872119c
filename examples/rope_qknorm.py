"""Rotary position embeddings (RoPE, Su et al., 2021) and RMS-normalised queries and keys, causal.

    theta_c = base ** (-2c / D),   a = p * theta_c
    rope(x) = concat(x1 cos(a) + x2 sin(a), -x1 sin(a) + x2 cos(a)),   x1, x2 = the halves of x
    norm(x) = x / sqrt(mean(x * x) + eps),   out = causal_attention(norm(rope(q)), norm(rope(k)), v)

RoPE rotates channel pairs (c, c + D/2) of the query or key at position p by
the angle p * theta_c, so q_i . k_j depends only on i - j; the half-split and
the signs are nanochat's ``apply_rotary_emb``.  The angles come from absolute
positions (``ac.index``), so a KV-cached decode rotates new tokens correctly.
"""

# Dimension names such as ac.f32["B", "T"] are sizes, not forward references.
# ruff: noqa: F821

import numpy as np

import attncomp as ac


def apply_rotary_emb(x, base: float):
    """Rotate the halves of the last axis of ``x`` [B, H, T, D] by position along T."""
    d = x.shape[-1] // 2
    x1, x2 = x[..., :d], x[..., d:]
    _, _, position, channel = ac.index(x1)
    inv_freq = base ** (-2 * channel / x.shape[-1])  # nanochat: 1 / base ** (arange(0, D, 2) / D)
    angle = position * inv_freq
    cos, sin = ac.cos(angle), ac.sin(angle)
    y1 = x1 * cos + x2 * sin
    y2 = -x1 * sin + x2 * cos
    rotated = ac.concat([y1, y2], axis=-1)
    return rotated


def rms_norm(x, eps: float):
    """x / sqrt(mean(x * x) + eps) over the last axis; nanochat's ``norm``, without weights."""
    mean_square = ac.mean(x * x, axis=-1, keepdims=True)
    normed = x * ac.rsqrt(mean_square + eps)
    return normed


@ac.spec
def rope_qknorm(
    q: ac.f32["B", "H", "T", "D"],
    k: ac.f32["B", "H", "S", "D"],
    v: ac.f32["B", "H", "S", "E"],
    *,
    base: float = 10000.0,
    eps: float = 2.0**-23,  # float32 machine epsilon, torch's rms_norm default
):
    q = rms_norm(apply_rotary_emb(q, base), eps)
    k = rms_norm(apply_rotary_emb(k, base), eps)
    scores = (q @ k.mT) * q.shape[-1] ** -0.5
    b, h, i, j = ac.index(scores)
    scores = ac.where(j <= i, scores, -ac.inf)
    return ac.softmax(scores, axis=-1) @ v


def numpy_rotary(x: np.ndarray, base: float) -> np.ndarray:
    """nanochat's rotary embedding in float64 for ``x`` [B, H, T, D], positions 0..T-1."""
    head_dim = x.shape[-1]
    inv_freq = 1.0 / base ** (np.arange(0, head_dim, 2) / head_dim)
    angles = np.outer(np.arange(x.shape[-2]), inv_freq)  # [T, D/2]
    cos, sin = np.cos(angles), np.sin(angles)
    x1, x2 = x[..., : head_dim // 2], x[..., head_dim // 2 :]
    return np.concatenate([x1 * cos + x2 * sin, x1 * (-sin) + x2 * cos], axis=-1)


def numpy_rms_norm(x: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + eps)


def numpy_reference(q, k, v, *, base: float = 10000.0, eps: float = 2.0**-23) -> np.ndarray:
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    q = numpy_rms_norm(numpy_rotary(q, base), eps)
    k = numpy_rms_norm(numpy_rotary(k, base), eps)
    T, S = q.shape[-2], k.shape[-2]
    scores = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    scores[..., np.arange(S)[None, :] > np.arange(T)[:, None]] = -np.inf
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

    inputs = make_inputs(np.random.default_rng(0), B=2, H=8, T=1024, S=1024, D=64, E=64)
    run_example(rope_qknorm, numpy_reference, inputs)
