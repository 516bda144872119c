"""Document masking: several documents packed into one sequence, each attending only to itself.

    visible(b, i, j) = doc[b, i] == doc[b, j]  and  j <= i
    out = softmax(where(visible, q @ k^T / sqrt(D), -inf)) @ v

``doc[b, t]`` is the id of the document token ``t`` belongs to.  This is
self-attention (queries and keys are the same tokens), so one size ``T``
serves both and ``doc`` is indexed at the query position ``i`` and the key
position ``j`` alike.
"""

# Dimension names such as ac.f32["B", "T"] are sizes, not forward references.
# ruff: noqa: F821

import numpy as np

import attncomp as ac


@ac.spec
def causal_document_mask(
    q: ac.f32["B", "H", "T", "D"],
    k: ac.f32["B", "H", "T", "D"],
    v: ac.f32["B", "H", "T", "E"],
    doc: ac.i32["B", "T"],
):
    scores = (q @ k.mT) * q.shape[-1] ** -0.5
    b, h, i, j = ac.index(scores)
    same_document = doc[b, i] == doc[b, j]
    scores = ac.where(same_document & (j <= i), scores, -ac.inf)
    return ac.softmax(scores, axis=-1) @ v


def numpy_reference(q, k, v, doc) -> np.ndarray:
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    B, H, T, _ = q.shape
    out = np.zeros((B, H, T, v.shape[-1]))
    for b in range(B):
        for i in range(T):
            keys = [j for j in range(i + 1) if doc[b, j] == doc[b, i]]
            scores = q[b, :, i : i + 1] @ np.swapaxes(k[b][:, keys], -1, -2) / np.sqrt(q.shape[-1])
            weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
            weights /= weights.sum(axis=-1, keepdims=True)
            out[b, :, i] = (weights @ v[b][:, keys])[:, 0]
    return out


def make_inputs(rng: np.random.Generator, *, B=2, H=2, T=16, D=8, E=8, n_docs=3) -> list[np.ndarray]:
    q = rng.standard_normal((B, H, T, D), dtype=np.float32)
    k = rng.standard_normal((B, H, T, D), dtype=np.float32)
    v = rng.standard_normal((B, H, T, E), dtype=np.float32)
    doc = np.zeros((B, T), dtype=np.int32)
    for b in range(B):
        # packed documents are contiguous runs: ids step up at n_docs - 1 random boundaries
        starts = rng.choice(np.arange(1, T), size=min(n_docs, T) - 1, replace=False)
        doc[b, starts] = 1
        doc[b] = np.cumsum(doc[b])
    return [q, k, v, doc]


if __name__ == "__main__":
    from _harness import run_example

    inputs = make_inputs(np.random.default_rng(0), B=2, H=8, T=1024, D=64, E=64, n_docs=5)
    print("document lengths:", [np.bincount(d).tolist() for d in inputs[-1]])
    run_example(causal_document_mask, numpy_reference, inputs)
