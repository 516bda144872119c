"""``ac.plot_attention``: a heatmap PNG of one head's attention weights."""

# Dimension names in annotations (ac.f32["T", "D"]) are not forward references.
# ruff: noqa: F821, UP037

import sys

import numpy as np
import pytest
from conftest import load_example

import attncomp as ac

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def assert_png(path) -> None:
    assert path.is_file()
    assert path.read_bytes()[:8] == PNG_SIGNATURE


def assert_rows_sum_to_one_or_zero(weights: np.ndarray) -> None:
    sums = weights.sum(axis=-1)
    assert np.all(np.isclose(sums, 1.0) | np.isclose(sums, 0.0)), sums


@pytest.fixture
def matplotlib():
    return pytest.importorskip("matplotlib")


def test_writes_a_png_of_the_causal_weights(matplotlib, tmp_path, rng):
    causal = load_example("causal")
    inputs = causal.make_inputs(rng, B=2, H=3, T=12, S=12)
    path = tmp_path / "causal.png"
    weights = ac.plot_attention(causal.causal, *inputs, batch=1, head=2, path=path)
    assert_png(path)
    assert weights.shape == (12, 12)
    assert_rows_sum_to_one_or_zero(weights)
    assert np.all(np.triu(weights, k=1) == 0), "a causal head attends to no later key"
    assert np.all(np.diag(weights) > 0)


def test_the_weights_are_those_of_the_chosen_batch_and_head(matplotlib, tmp_path, rng):
    sdpa = load_example("sdpa")
    q, k, v = sdpa.make_inputs(rng, B=2, H=3, T=5, S=7)
    weights = ac.plot_attention(sdpa.sdpa, q, k, v, batch=1, head=2, path=tmp_path / "sdpa.png")
    scores = q[1, 2].astype(np.float64) @ k[1, 2].T.astype(np.float64) / np.sqrt(q.shape[-1])
    expected = np.exp(scores - scores.max(-1, keepdims=True))
    expected /= expected.sum(-1, keepdims=True)
    np.testing.assert_allclose(weights, expected, rtol=1e-12)


def test_token_labels_for_both_axes_or_each(matplotlib, tmp_path):
    walk = load_example("seed_walkthrough")
    inputs = walk.as_f32(walk.CAT_SAT_Q, walk.CAT_SAT_K, walk.CAT_SAT_V)
    path = tmp_path / "cat_sat.png"
    weights = ac.plot_attention(walk.cat_sat, *inputs, path=path, tokens=["The", "cat", "sat"])
    assert_png(path)
    assert weights.shape == (3, 3)
    assert_rows_sum_to_one_or_zero(weights)
    # the tutorial's second row: scores [1, 1, 0] / 2 -> weights [0.384, 0.384, 0.233]
    np.testing.assert_allclose(weights[1], [0.3837, 0.3837, 0.2327], atol=1e-4)

    one = walk.as_f32(walk.ONE_QUERY_Q, walk.ONE_QUERY_K, walk.ONE_QUERY_V)
    path = tmp_path / "one_query.png"
    weights = ac.plot_attention(walk.one_query_unscaled, *one, path=path, tokens=(["q"], ["A", "B", "C"]))
    assert_png(path)
    assert weights.shape == (1, 3)


def test_token_labels_must_match_the_positions(matplotlib, tmp_path):
    walk = load_example("seed_walkthrough")
    inputs = walk.as_f32(walk.CAT_SAT_Q, walk.CAT_SAT_K, walk.CAT_SAT_V)
    with pytest.raises(ValueError, match="2 query tokens for 3 query positions"):
        ac.plot_attention(walk.cat_sat, *inputs, path=tmp_path / "x.png", tokens=["The", "cat"])


def test_fully_masked_rows_are_zero(matplotlib, tmp_path, rng):
    padding = load_example("padding")
    q, k, v, _ = padding.make_inputs(rng, B=2, H=1, T=6, S=6)
    lengths = np.array([3, 0], dtype=np.int32)
    path = tmp_path / "padding.png"
    weights = ac.plot_attention(padding.key_padding, q, k, v, lengths, batch=0, path=path)
    assert_rows_sum_to_one_or_zero(weights)
    assert np.all(weights[:, 3:] == 0) and np.allclose(weights.sum(-1), 1.0)
    empty = ac.plot_attention(padding.key_padding, q, k, v, lengths, batch=1, path=path)
    assert np.all(empty == 0)


def test_softmax_spelled_out_and_constants(matplotlib, tmp_path, rng):
    spelled = load_example("softmax_spelled_out")
    inputs = spelled.make_inputs(rng, T=9, S=9)
    by_hand = ac.plot_attention(spelled.causal_softmax_spelled_out, *inputs, path=tmp_path / "a.png")
    builtin = ac.plot_attention(spelled.causal_softmax_builtin, *inputs, path=tmp_path / "b.png")
    np.testing.assert_allclose(by_hand, builtin, rtol=1e-12)

    window = load_example("sliding_window")
    weights = ac.plot_attention(
        window.causal_sliding_window, *window.make_inputs(rng, T=9, S=9), path=tmp_path / "w.png", window=3
    )
    i, j = np.indices(weights.shape)
    assert np.all(weights[(j > i) | (i - j >= 3)] == 0)
    assert np.all(weights[(j <= i) & (i - j < 3)] > 0)


def test_a_spec_without_softmax_is_refused(matplotlib, tmp_path):
    @ac.spec
    def scores_only(q: ac.f32["T", "D"], k: ac.f32["S", "D"]):
        return q @ k.mT

    x = np.ones((4, 2), np.float32)
    with pytest.raises(ac.AttncompError, match="no attention weights to plot"):
        ac.plot_attention(scores_only, x, x, path=tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


def test_without_matplotlib_says_how_to_install_it(monkeypatch, tmp_path, rng):
    for name in [n for n in sys.modules if n == "matplotlib" or n.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # None in sys.modules: the import fails
    causal = load_example("causal")
    with pytest.raises(ImportError) as info:
        ac.plot_attention(causal.causal, *causal.make_inputs(rng), path=tmp_path / "x.png")
    assert str(info.value) == "ac.plot_attention needs matplotlib: pip install 'attncomp[plot]'"
    assert not (tmp_path / "x.png").exists()
