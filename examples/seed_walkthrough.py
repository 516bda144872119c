"""The tutorials' worked examples of attention, run step by step through the interpreter.

    out = softmax(q @ k^T / sqrt(d_k)) @ v

(a) "The cat sat": three tokens with d_k = 4, scaled by 1/sqrt(d_k), no mask;
    (a') the same with a causal mask.
(b) One query [1, 0] against three keys, without the scaling.

Every number printed here is computed, not copied.  One tutorial's table
gives the second row of (a)'s scores as [1, 2, 0]; the dot products of
Q[1] = [0, 1, 0, 1] with the keys are [1, 1, 0], as the trace below shows.  The specs
name each step (scores, scaled, weights, out), and ``ac.interpret(...,
trace=True)`` returns every value under its IR name.
"""

# Dimension names such as ac.f32["B", "T"] are sizes, not forward references.
# ruff: noqa: F821

import numpy as np

import attncomp as ac

# "The cat sat" after projection: one row per token, d_k = 4
CAT_SAT_Q = [[1, 0, 1, 0], [0, 1, 0, 1], [1, 1, 0, 0]]
CAT_SAT_K = [[1, 0, 0, 1], [0, 1, 1, 0], [1, 0, 1, 0]]
CAT_SAT_V = [[0.1, 0.2, 0.3, 0.4], [0.5, 0.6, 0.7, 0.8], [0.9, 1.0, 1.1, 1.2]]
# one query, keys of tokens A, B, C, their values
ONE_QUERY_Q = [[1.0, 0.0]]
ONE_QUERY_K = [[1.0, 0.0], [0.0, 1.0], [0.7, 0.7]]
ONE_QUERY_V = [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]


@ac.spec
def cat_sat(q: ac.f32["T", "D"], k: ac.f32["S", "D"], v: ac.f32["S", "E"]):
    scores = q @ k.mT
    d_k = q.shape[-1]
    scaled = scores / d_k**0.5
    weights = ac.softmax(scaled, axis=-1)
    out = weights @ v
    return out


@ac.spec
def cat_sat_causal(q: ac.f32["T", "D"], k: ac.f32["S", "D"], v: ac.f32["S", "E"]):
    scores = q @ k.mT
    d_k = q.shape[-1]
    scaled = scores / d_k**0.5
    i, j = ac.index(scaled)
    masked = ac.where(j <= i, scaled, -ac.inf)
    weights = ac.softmax(masked, axis=-1)
    out = weights @ v
    return out


@ac.spec
def one_query_unscaled(q: ac.f32["T", "D"], k: ac.f32["S", "D"], v: ac.f32["S", "E"]):
    scores = q @ k.mT
    weights = ac.softmax(scores, axis=-1)
    out = weights @ v
    return out


def numpy_reference(q, k, v, *, scaled: bool = True, causal: bool = False) -> np.ndarray:
    """``cat_sat`` by default; ``causal=True`` for ``cat_sat_causal``, ``scaled=False`` for the one query."""
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    out = np.zeros((q.shape[0], v.shape[1]))
    for i, query in enumerate(q):
        keys = range(min(i + 1, len(k))) if causal else range(len(k))
        scores = np.array([sum(a * b for a, b in zip(query, k[j])) for j in keys])
        if scaled:
            scores = scores / np.sqrt(q.shape[1])
        weights = np.exp(scores) / np.exp(scores).sum()  # small scores: no overflow to guard
        out[i] = sum(w * v[j] for w, j in zip(weights, keys))
    return out


def make_inputs(rng: np.random.Generator, *, T=3, S=3, D=4, E=4) -> list[np.ndarray]:
    """Random inputs of the walkthrough's shapes (the worked examples use fixed numbers)."""
    q = rng.standard_normal((T, D), dtype=np.float32)
    k = rng.standard_normal((S, D), dtype=np.float32)
    v = rng.standard_normal((S, E), dtype=np.float32)
    return [q, k, v]


def as_f32(*rows_lists) -> list[np.ndarray]:
    return [np.asarray(rows, dtype=np.float32) for rows in rows_lists]


def show_steps(spec: ac.Spec, inputs: list[np.ndarray]) -> None:
    """Print every value the spec named (inputs and numbered temporaries left out)."""
    _, values = ac.interpret(spec, *inputs, trace=True)
    arguments = set(spec.arg_names)
    print(f"--- {spec.name}")
    for name, value in values.items():
        if name not in arguments and not name.isdigit():
            text = np.array2string(np.round(value, 4), precision=4, suppress_small=True)
            print(f"{name} =\n{text}")


if __name__ == "__main__":
    from functools import partial

    from _harness import run_example

    np.set_printoptions(floatmode="fixed")
    cat_sat_inputs = as_f32(CAT_SAT_Q, CAT_SAT_K, CAT_SAT_V)
    one_query_inputs = as_f32(ONE_QUERY_Q, ONE_QUERY_K, ONE_QUERY_V)
    show_steps(cat_sat, cat_sat_inputs)
    show_steps(cat_sat_causal, cat_sat_inputs)
    show_steps(one_query_unscaled, one_query_inputs)
    print()
    run_example(cat_sat, numpy_reference, cat_sat_inputs)
    run_example(cat_sat_causal, partial(numpy_reference, causal=True), cat_sat_inputs)
    run_example(one_query_unscaled, partial(numpy_reference, scaled=False), one_query_inputs)
