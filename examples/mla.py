"""Multi-head latent attention (MLA, DeepSeek-V2/V3): the prefill shape and the absorbed decode.

Prefill: queries and keys of 192 features (128 of content, 64 of rotary position),
values of 128, causal:

    out = softmax(where(j <= i, q @ k^T / sqrt(192), -inf)) @ v

Absorbed decoding: the key and value projections are folded into the queries and the
output projection, so every head attends over one shared latent cache of 576 features
per token (512 compressed, 64 rotary): the keys are the whole latent, the values its
first 512 features.  All heads read the same latent (``repeat_kv`` of one key/value
head: no copy), and the scale stays the prefill's ``192 ** -0.5``:

    out_h = softmax(q_h @ c^T / sqrt(192)) @ c[:, :512]

Queries sit at the end of the keys (``j <= i + S - T``): one new token sees every
cached one.
"""

# Dimension names such as ac.f32["B", "T"] are sizes, not forward references.
# ruff: noqa: F821

import numpy as np

import attncomp as ac

#: the prefill's query/key features, whose square root scales the scores in both shapes
QK_FEATURES = 192
#: the latent's features that are values (the rest are rotary)
VALUE_FEATURES = 512


@ac.spec
def mla_prefill(
    q: ac.floating["B", "H", "T", "D"],
    k: ac.floating["B", "H", "S", "D"],
    v: ac.floating["B", "H", "S", "E"],
):
    scores = (q @ k.mT) * q.shape[-1] ** -0.5
    b, h, i, j = ac.index(scores)
    return ac.softmax(ac.where(j <= i, scores, -ac.inf), axis=-1) @ v


@ac.spec
def mla_absorbed_decode(q: ac.floating["B", "H", "T", "L"], latent: ac.floating["B", "KV", "S", "L"]):
    group = q.shape[1] // latent.shape[1]
    keys = ac.repeat_kv(latent, group)
    values = ac.repeat_kv(latent[..., :VALUE_FEATURES], group)
    scores = (q @ keys.mT) * QK_FEATURES**-0.5
    b, h, i, j = ac.index(scores)
    scores = ac.where(j <= i + (latent.shape[2] - q.shape[2]), scores, -ac.inf)
    return ac.softmax(scores, axis=-1) @ values


def numpy_reference(*args: np.ndarray) -> np.ndarray:
    """Either spec in float64: ``(q, k, v)`` for the prefill, ``(q, latent)`` for the decode."""
    if len(args) == 3:
        q, k, v = (np.asarray(a, dtype=np.float64) for a in args)
        scale = q.shape[-1] ** -0.5
    else:
        q, latent = (np.asarray(a, dtype=np.float64) for a in args)
        group = q.shape[1] // latent.shape[1]
        k = np.repeat(latent, group, axis=1)
        v = k[..., :VALUE_FEATURES]
        scale = QK_FEATURES**-0.5
    T, S = q.shape[-2], k.shape[-2]
    s = q @ np.swapaxes(k, -1, -2) * scale
    visible = np.arange(S)[None, :] <= np.arange(T)[:, None] + (S - T if len(args) == 2 else 0)
    s = np.where(visible, s, -np.inf)
    w = np.exp(s - s.max(axis=-1, keepdims=True))
    return (w / w.sum(axis=-1, keepdims=True)) @ v


def make_inputs(rng: np.random.Generator, *, B=1, H=4, T=40, S=40, decode: bool = False) -> list[np.ndarray]:
    """The prefill's q, k, v (192, 192, 128 features), or with ``decode`` the decode's q and
    one latent head (576 features)."""
    if decode:
        q = rng.standard_normal((B, H, T, VALUE_FEATURES + 64), dtype=np.float32)
        return [q, rng.standard_normal((B, 1, S, VALUE_FEATURES + 64), dtype=np.float32)]
    q = rng.standard_normal((B, H, T, QK_FEATURES), dtype=np.float32)
    k = rng.standard_normal((B, H, S, QK_FEATURES), dtype=np.float32)
    return [q, k, rng.standard_normal((B, H, S, 128), dtype=np.float32)]


if __name__ == "__main__":
    from _harness import run_example

    rng = np.random.default_rng(0)
    run_example(mla_prefill, numpy_reference, make_inputs(rng, B=1, H=16, T=512, S=512))
    run_example(mla_absorbed_decode, numpy_reference, make_inputs(rng, B=1, H=16, T=1, S=2048, decode=True))
