"""The seed example, value by value: ``trace=True`` against a float64 numpy computation.

Three tokens ("The", "cat", "sat"), d_k = 4, scale 1/sqrt(4), no mask.
"""

# Dimension names in annotations (ac.f32["T", "D"]) are not forward references.
# ruff: noqa: F821, UP037

import numpy as np
import pytest

import attncomp as ac

TOKENS = ["The", "cat", "sat"]
Q = np.array([[1, 0, 1, 0], [0, 1, 0, 1], [1, 1, 0, 0]], dtype=np.float32)
K = np.array([[1, 0, 0, 1], [0, 1, 1, 0], [1, 0, 1, 0]], dtype=np.float32)
V = np.array([[0.1, 0.2, 0.3, 0.4], [0.5, 0.6, 0.7, 0.8], [0.9, 1.0, 1.1, 1.2]], dtype=np.float32)


@ac.spec
def seed(q: ac.f32["T", "D"], k: ac.f32["S", "D"], v: ac.f32["S", "E"]):
    scores = q @ k.mT
    scaled = scores * q.shape[-1] ** -0.5
    weights = ac.softmax(scaled, axis=-1)
    return weights @ v


def reference() -> dict[str, np.ndarray]:
    q, k, v = (a.astype(np.float64) for a in (Q, K, V))
    scores = q @ k.T
    scaled = scores / np.sqrt(4.0)
    e = np.exp(scaled - scaled.max(axis=1, keepdims=True))
    weights = e / e.sum(axis=1, keepdims=True)
    return {"scores": scores, "scaled": scaled, "weights": weights, "out": weights @ v}


@pytest.fixture(scope="module")
def traced():
    return ac.interpret(seed, Q, K, V, trace=True)


def test_trace_names_follow_the_spec(traced):
    _, values = traced
    assert list(values) == ["q", "k", "v", "0", "scores", "1", "2", "3", "scaled", "weights", "out"]
    text = str(seed.ir)
    for name in values:
        assert f"%{name}" in text


def test_inputs_are_traced_as_float64(traced):
    _, values = traced
    for name, array in zip("qkv", (Q, K, V)):
        assert values[name].dtype == np.float64
        np.testing.assert_array_equal(values[name], array.astype(np.float64))


def test_scores_are_q_times_k_transposed(traced):
    _, values = traced
    np.testing.assert_array_equal(values["0"], K.T.astype(np.float64))
    np.testing.assert_array_equal(values["scores"], reference()["scores"])
    # worked by hand: each score counts the positions where query and key are both 1
    np.testing.assert_array_equal(values["scores"], [[1, 1, 2], [1, 1, 0], [1, 1, 1]])


def test_scale_is_one_over_sqrt_d(traced):
    _, values = traced
    assert values["1"] == 4 and values["1"].dtype == np.int64
    assert values["2"] == -0.5
    assert values["3"] == 0.5
    np.testing.assert_allclose(values["scaled"], reference()["scaled"], rtol=1e-12)


def test_softmax_weights(traced):
    _, values = traced
    weights = values["weights"]
    np.testing.assert_allclose(weights, reference()["weights"], rtol=1e-12)
    np.testing.assert_allclose(weights.sum(axis=1), np.ones(3), rtol=1e-12)
    # "The" attends most to "sat", the key it shares two positions with
    assert TOKENS[int(np.argmax(weights[0]))] == "sat"
    # "cat" scores "The" and "cat" alike and "sat" lower
    assert weights[1, 0] == pytest.approx(weights[1, 1], rel=1e-12) and weights[1, 2] < weights[1, 0]
    # "sat" scores every key alike: uniform weights
    np.testing.assert_allclose(weights[2], np.full(3, 1 / 3), rtol=1e-12)


def test_output(traced):
    out, values = traced
    want = reference()["out"]
    np.testing.assert_allclose(out, want, rtol=1e-12)
    np.testing.assert_array_equal(values["out"], out)
    np.testing.assert_allclose(out[2], V.astype(np.float64).mean(axis=0), rtol=1e-12)


def test_compiled_function_agrees(traced):
    out, _ = traced
    got = ac.compile(seed, backend="interp")(Q, K, V)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, out, rtol=1e-6)
