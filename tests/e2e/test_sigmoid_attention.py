"""Sigmoid attention (``where(mask, sigmoid(f(q kᵀ)), 0) @ v``): fused by softmax-fusion into an
unnormalised ``ac.attention`` (``normalized = false``), tiled, masked, decoded and differentiated as
softmax attention is, against the float64 formula (``scipy.special.expit``)."""

# ruff: noqa: F821

import numpy as np
import pytest
from scipy.special import expit

import attncomp as ac
from tests.passes import specs


@ac.spec
def outside(q: ac.floating["B", "H", "T", "D"], k: ac.floating["B", "H", "S", "D"], v: ac.floating["B", "H", "S", "E"]):
    """The mask outside the logistic function, a bias inside; any float type."""
    s = (q @ k.mT) * q.shape[-1] ** -0.5 - 1.5
    b, h, i, j = ac.index(s)
    return ac.where(j <= i, ac.sigmoid(s), 0.0) @ v


@ac.spec
def spelled(q: ac.f32["T", "D"], k: ac.f32["S", "D"], v: ac.f32["S", "E"]):
    """``1 / (1 + exp(-x))`` written out, no mask."""
    s = q @ k.mT * 0.5
    return (1.0 / (1.0 + ac.exp(-s))) @ v


@ac.spec
def also_returned(q: ac.f32["T", "D"], k: ac.f32["S", "D"], v: ac.f32["S", "E"]):
    p = ac.sigmoid(q @ k.mT)
    return p @ v, p


def expected(q, k, v, slopes=None, bias=-2.0, causal=True, scale=None):
    """The float64 formula: causal ``sigmoid(q kᵀ scale + slopes[h] (j - i) + bias) @ v``."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    T, S = q.shape[-2], k.shape[-2]
    s = q @ np.swapaxes(k, -1, -2) * (scale or q.shape[-1] ** -0.5) + bias
    if slopes is not None:
        s = s + np.asarray(slopes, np.float64)[:, None, None] * (np.arange(S)[None, :] - np.arange(T)[:, None])
    p = expit(s)
    if causal:
        p = np.where(np.arange(S)[None, :] <= np.arange(T)[:, None], p, 0.0)
    return p


def normal(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def attention_ops(fn) -> list:
    return [op for op in ac.parse_ir(fn.ir("softmax-fusion")).main.body.ops if op.name == "ac.attention"]


@pytest.mark.parametrize("spec", [specs.sigmoid_alibi, outside, spelled])
def test_each_form_fuses_into_one_unnormalised_attention(spec):
    fn = ac.compile(spec, backend="interp")
    (op,) = attention_ops(fn)
    assert op.attrs["normalized"] is False and op.attrs["with_lse"] is False
    assert fn.remarks == []
    assert "ac.matmul" not in fn.ir("softmax-fusion")  # no T x S product is left outside the op
    text = fn.ir("final")
    assert "ac.tile_grid" in text and "normalized = false" in text


def test_probabilities_used_elsewhere_are_not_fused_and_say_why():
    fn = ac.compile(also_returned, backend="interp")
    assert attention_ops(fn) == []
    assert fn.remarks == [
        "softmax-fusion: sigmoid attention not fused: the sigmoid probabilities %p are used by "
        "something other than p @ v"
    ]


def test_the_pass_option_leaves_it_unfused():
    fn = ac.compile(outside, backend="interp", pipeline="softmax-fusion{sigmoid=false}")
    assert attention_ops(fn) == []


@pytest.mark.parametrize("backend", ["interp", "cpu"])
def test_outputs_match_the_formula(backend):
    """Prefill sizes, a decode-like call (one row over many keys: the cpu splits its keys and merges the
    parts, which add up), and a row whose every key is masked (zeros)."""
    rng = np.random.default_rng(0)
    fn = ac.compile(specs.sigmoid_alibi, backend=backend)
    for T, S in ((45, 45), (1, 3000), (3, 200)):
        q, k, v = normal(rng, 1, 2, T, 16), normal(rng, 1, 2, S, 16), normal(rng, 1, 2, S, 8)
        slopes = rng.uniform(0.0, 0.1, 2).astype(np.float32)
        want = expected(q, k, v, slopes, causal=True) @ v.astype(np.float64)
        got = np.asarray(fn(q, k, v, slopes), np.float64)
        assert np.abs(got - want).max() <= 2e-6 * max(1.0, np.abs(want).max()), (T, S)
    no_keys = normal(rng, 1, 2, 0, 16)
    out = fn(normal(rng, 1, 2, 4, 16), no_keys, no_keys[..., :8], slopes)
    assert out.shape == (1, 2, 4, 8) and not out.any()  # no keys at all: zeros


@pytest.mark.parametrize("backend", ["interp", "cpu"])
def test_gradients_match_the_formula(backend):
    """dq, dk, dv and the slopes' gradient of ``P = sigmoid(s)``: ``dS = dP P (1 - P)``, no row term."""
    rng = np.random.default_rng(1)
    T, S, D = 70, 90, 16
    q, k, v = normal(rng, 1, 2, T, D), normal(rng, 1, 2, S, D), normal(rng, 1, 2, S, 8)
    slopes = rng.uniform(0.0, 0.1, 2).astype(np.float32)
    d_out = normal(rng, 1, 2, T, 8)
    _, backward = ac.compile(specs.sigmoid_alibi, backend=backend).vjp(q, k, v, slopes)
    got = backward(d_out)
    q64, k64, v64, do64 = (x.astype(np.float64) for x in (q, k, v, d_out))
    p = expected(q, k, v, slopes)
    ds = (do64 @ np.swapaxes(v64, -1, -2)) * p * (1.0 - p) * D**-0.5
    distance = np.arange(S)[None, :] - np.arange(T)[:, None]
    want = [ds @ k64, np.swapaxes(ds, -1, -2) @ q64, np.swapaxes(p, -1, -2) @ do64]
    want.append((ds * distance).sum(axis=(0, 2, 3)) / D**-0.5)
    for name, g, w in zip(("dq", "dk", "dv", "dslopes"), got, want):
        assert np.abs(np.asarray(g, np.float64) - w).max() <= 1e-5 * np.abs(w).max(), name


def test_a_decoder_steps_through_the_whole_sequences_result():
    rng = np.random.default_rng(2)
    fn = ac.compile(specs.sigmoid_alibi, backend="cpu")
    q, k, v = normal(rng, 1, 2, 20, 16), normal(rng, 1, 2, 20, 16), normal(rng, 1, 2, 20, 8)
    slopes = rng.uniform(0.0, 0.1, 2).astype(np.float32)
    decoder = fn.decoder(max_len=32)
    steps = [decoder(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], slopes) for a, b in ((0, 7), (7, 8), (8, 20))]
    want = expected(q, k, v, slopes) @ v.astype(np.float64)
    assert np.abs(np.concatenate(steps, axis=2) - want).max() <= 2e-6 * np.abs(want).max()


def test_bf16_inputs_stay_within_bf16_rounding():
    import ml_dtypes

    rng = np.random.default_rng(3)
    q, k, v = (normal(rng, 1, 2, 64, 32).astype(ml_dtypes.bfloat16) for _ in range(3))
    got = np.asarray(ac.compile(outside, backend="cpu")(q, k, v), np.float64)
    want = expected(q, k, v, bias=-1.5) @ np.asarray(v, np.float64)
    assert np.abs(got - want).max() <= 1e-2 * np.abs(want).max()


def test_dask_chunks_add_their_partial_results():
    """Chunk pairs of an unnormalised attention are sums over their keys: merged, they add up (a
    log-sum-exp merge would weigh them as means)."""
    da = pytest.importorskip("dask.array")
    rng = np.random.default_rng(4)
    q, k, v = normal(rng, 1, 2, 40, 16), normal(rng, 1, 2, 40, 16), normal(rng, 1, 2, 40, 8)
    slopes = rng.uniform(0.0, 0.1, 2).astype(np.float32)
    fn = ac.compile(specs.sigmoid_alibi, backend="interp")  # the merges are the host's, whatever the backend
    chunks = [da.from_array(x, chunks=(1, 1, 12, x.shape[-1])) for x in (q, k, v)]
    got = np.asarray(fn(*chunks, slopes).compute(), np.float64)
    want = expected(q, k, v, slopes) @ v.astype(np.float64)
    assert np.abs(got - want).max() <= 2e-6 * np.abs(want).max()


def test_a_paged_decoder_with_a_forked_prompt_in_cascade():
    """Pages, and a shared prompt attended once for both sequences (its partial result added to each
    sequence's own)."""
    rng = np.random.default_rng(5)
    fn = ac.compile(specs.sigmoid_alibi, backend="interp")  # the cascade's merge is the host's
    slopes = rng.uniform(0.0, 0.1, 2).astype(np.float32)
    srv = fn.paged_decoder(page_size=8, num_pages=32)
    srv.cascade_min = 8  # the shared prompt of 24 rows is attended in cascade
    q, k, v = normal(rng, 1, 2, 30, 16), normal(rng, 1, 2, 30, 16), normal(rng, 1, 2, 30, 8)
    first = srv.new()
    prompt = srv.step({first: (q[:, :, :24], k[:, :, :24], v[:, :, :24], slopes)})[first]
    second = srv.fork(first)
    q2, k2, v2 = (np.concatenate([x[:, :, :24], normal(rng, 1, 2, 6, x.shape[-1])], axis=2) for x in (q, k, v))
    steps = srv.step(
        {
            first: (q[:, :, 24:], k[:, :, 24:], v[:, :, 24:], slopes),
            second: (q2[:, :, 24:], k2[:, :, 24:], v2[:, :, 24:], slopes),
        }
    )
    for seq, (a, b, c) in ((first, (q, k, v)), (second, (q2, k2, v2))):
        got = np.concatenate([prompt, steps[seq]], axis=2)
        want = expected(a, b, c, slopes) @ c.astype(np.float64)
        assert np.abs(got - want).max() <= 2e-6 * np.abs(want).max(), seq


@ac.spec
def gate(x: ac.f32["T", "F"], w: ac.f32["F", "E"]):
    return ac.sigmoid(x) @ w


def test_a_logistic_function_of_no_product_is_left_alone_without_a_remark():
    fn = ac.compile(gate, backend="interp")
    assert attention_ops(fn) == [] and fn.remarks == []


def test_the_torch_function_matches_pytorchs_eager_sigmoid_attention():
    """``attncomp.sigmoid_attention.sigmoid_attention``: causal, a window, GQA, its default bias
    ``-log S``, outputs and gradients against the same formula in PyTorch's eager ops; 3-dim inputs
    are one head; bad arguments are named."""
    torch = pytest.importorskip("torch")
    import math

    from attncomp.sigmoid_attention import sigmoid_attention, sigmoid_attention_spec

    fn = ac.compile(sigmoid_attention_spec, backend="interp", causal=True, window=20)
    assert [op.attrs.get("normalized") for op in attention_ops(fn)] == [False]
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 45, 16, generator=generator, requires_grad=True)
    k, v = (torch.randn(2, 2, 45, 16, generator=generator, requires_grad=True) for _ in range(2))
    out = sigmoid_attention(q, k, v, is_causal=True, window=20, enable_gqa=True)
    rows, keys = torch.arange(45)[:, None], torch.arange(45)[None]
    scores = q @ k.repeat_interleave(2, 1).transpose(-1, -2) / 4.0 - math.log(45)
    want = torch.where((keys <= rows) & (rows - keys < 20), torch.sigmoid(scores), 0.0) @ v.repeat_interleave(2, 1)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    d_out = torch.randn(out.shape, generator=generator)
    for got, expect in zip(torch.autograd.grad(out, (q, k, v), d_out), torch.autograd.grad(want, (q, k, v), d_out)):
        torch.testing.assert_close(got, expect, rtol=1e-4, atol=1e-5)
    one_head = sigmoid_attention(q[:, 0], k[:, 0], v[:, 0], bias=-1.0, scale=0.5)
    expect = torch.sigmoid(q[:, 0] @ k[:, 0].transpose(-1, -2) * 0.5 - 1.0) @ v[:, 0]
    torch.testing.assert_close(one_head, expect, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="window must be a positive int"):
        sigmoid_attention(q, k, v, window=0, enable_gqa=True)
    with pytest.raises(ValueError, match="pass enable_gqa=True"):
        sigmoid_attention(q, k, v)
