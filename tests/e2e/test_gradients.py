"""Gradients (docs/api.md section 5): fn.vjp and fn.backward, derived by the autodiff pass.

Every example spec, unfused and fused: the pullback's gradients against
central finite differences of the float64 interpreter (directional
derivatives along random directions), and every stage of the backward IR,
interpreted, against the unfused graph's gradients.
"""

# Dimension names in annotations (ac.f64["T", "D"]) are not forward references.
# ruff: noqa: F821, UP037

from __future__ import annotations

import numpy as np
import pytest
from test_examples import Case, all_cases

import attncomp as ac
from attncomp.testing import directional_derivatives, interpret_float64, relative_error

#: the graph-level pipeline: softmax fused, nothing tiled
FUSED = "cse,softmax-fusion"


def as_tuple(x):
    return x if isinstance(x, tuple) else (x,)


def floats(inputs):
    return [np.asarray(a).dtype.kind == "f" for a in inputs]


def pullback_case(case: Case, pipeline: str | None, seed: int = 0):
    """(spec, inputs, cotangents, gradients) of ``case`` on the interpreter with ``pipeline``."""
    spec, inputs, _ = case.build(np.random.default_rng(seed))
    fn = ac.compile(spec, backend="interp", pipeline=pipeline, **case.constants)
    out, pullback = fn.vjp(*inputs)
    rng = np.random.default_rng(seed + 1)
    cotangents = [rng.standard_normal(np.shape(o)) for o in as_tuple(out)]
    return fn, inputs, cotangents, pullback(*cotangents)


@pytest.mark.parametrize("pipeline", ["", FUSED], ids=["unfused", "fused"])
@pytest.mark.parametrize("case", all_cases(), ids=lambda case: case.id)
def test_gradients_match_finite_differences(case: Case, pipeline: str):
    fn, inputs, cotangents, grads = pullback_case(case, pipeline)
    assert len(grads) == len(inputs)
    rng = np.random.default_rng(2)
    directions = [rng.standard_normal(np.shape(a)) if f else None for a, f in zip(inputs, floats(inputs))]
    numeric = directional_derivatives(fn.func, inputs, cotangents, directions)
    for k, (g, d, expected) in enumerate(zip(grads, directions, numeric)):
        if d is None:
            assert g is None, f"argument {k} is not floating: its gradient is None"
            continue
        assert g.shape == np.shape(inputs[k]) and g.dtype == np.float64
        got = float(np.sum(g * d))
        assert abs(got - expected) <= 1e-6 * max(abs(expected), 1e-3), f"argument {k}: {got} against {expected}"


@pytest.mark.parametrize("case", all_cases(), ids=lambda case: case.id)
def test_every_backward_stage_matches_the_unfused_gradients(case: Case):
    _, inputs, cotangents, unfused = pullback_case(case, "")
    fn = ac.compile(case.build(np.random.default_rng(0))[0], backend="interp", **case.constants)
    saving = fn.forward_saving
    outputs = interpret_float64(saving.func, inputs)
    saved = outputs[len(outputs) - saving.func.attrs.get("residuals", 0) :]
    backward = fn.backward
    stages = backward.stages[backward.stages.index("autodiff") :]
    assert stages[:2] == ["autodiff", "flash-tiling"]
    expected = [g for g in unfused if g is not None]
    for stage in stages:
        text = backward.ir(stage)
        module = ac.parse_ir(text)
        assert str(module) == text, f"{stage}: the text does not survive parse_ir"
        got = interpret_float64(module.main, [*inputs, *saved, *cotangents])
        for g, want in zip(got, expected):
            assert relative_error(g, want) < 1e-10, f"after {stage}"


def test_backward_is_inspectable():
    from examples.alibi import causal_alibi

    fn = ac.compile(causal_alibi, backend="interp", window=32)
    backward = fn.backward
    assert backward.stages[:3] == ["cse", "softmax-fusion", "autodiff"]
    text = backward.ir("autodiff")
    assert text.startswith("ac.func @causal_alibi_backward(%q: tensor<B x H x T x D x f32>")
    assert "%saved_out: tensor<B x H x T x E x f32>, %saved_lse: tensor<B x H x T x f32>" in text
    assert "ac.attention_grad" in text
    # the slope term of the score is differentiated, not written per variant: g * (j - i) at index h
    assert "ac.yield %16, %15, %h_2" in text
    assert "// ----- after autodiff -----" in backward.dump()
    assert backward.source == backward.ir("final")


def test_all_masked_rows_give_zero_gradients():
    """Key lengths of 0 mask every key of a batch entry: its gradients are 0, never NaN."""
    from examples.lse import key_padding_with_lse

    case = next(c for c in all_cases() if c.spec == "key_padding_with_lse")
    _, inputs, _ = case.build(np.random.default_rng(0))
    for pipeline in ("", None):
        fn = ac.compile(key_padding_with_lse, backend="interp", pipeline=pipeline)
        (out, lse), pullback = fn.vjp(*inputs)
        assert np.all(lse[2] == -np.inf)
        dq, dk, dv, dlengths = pullback(np.ones_like(out), np.ones_like(lse))
        assert dlengths is None
        for g in (dq, dk, dv):
            assert np.all(np.isfinite(g))
            assert np.all(g[2] == 0.0)


def test_pullback_arguments_are_checked():
    from examples.causal import causal

    q = k = v = np.random.default_rng(0).standard_normal((1, 2, 20, 8)).astype(np.float32)
    out, pullback = ac.compile(causal, backend="interp").vjp(q, k, v)
    with pytest.raises(TypeError, match="takes 1 cotangent"):
        pullback(out, out)
    with pytest.raises(ac.ShapeError, match=r"cotangent 0: expected shape \(1, 2, 20, 8\)"):
        pullback(out[:, :1])
    zero = pullback(None)
    assert all(np.all(g == 0.0) for g in zero)


def test_wrt_leaves_out_the_gradients_nobody_wants():
    """``fn.vjp(..., wrt=names)``: the other floating arguments' gradients are None, the backward
    compiled without them (a captured tensor's not computed at all); the wanted ones are the full
    backward's."""
    from attncomp.gradients import backward_of
    from examples.alibi import causal_alibi, make_inputs

    fn = ac.compile(causal_alibi, backend="interp", window=7)
    args = make_inputs(np.random.default_rng(1), T=20, S=20)
    d_out = np.random.default_rng(2).standard_normal(fn(*args).shape)
    full = fn.vjp(*args)[1](d_out)
    some = fn.vjp(*args, wrt=("q", "slopes"))[1](d_out)
    assert some[1] is None and some[2] is None
    for got, want in ((some[0], full[0]), (some[3], full[3])):
        np.testing.assert_array_equal(got, want)
    backward = backward_of(fn.compilation, ("k", "v"))  # the variant vjp made and ran
    assert "ac.return %d_q, %d_slopes\n" in backward.ir("autodiff")  # returns these two
    assert fn.vjp(*args, wrt=())[1](d_out) == (None, None, None, None)
    with pytest.raises(TypeError, match=r"wrt: @causal_alibi has no argument 'x'; its arguments: q, k, v, slopes"):
        fn.vjp(*args, wrt=("x",))
    with pytest.raises(TypeError, match=r"a sequence of argument names, such as \('q',\)"):
        fn.vjp(*args, wrt="q")


def test_gradients_agree_with_torch_autograd():
    torch = pytest.importorskip("torch", reason="the torch extra is not installed")
    from examples.softcap import causal_softcap

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 37, 8)) for _ in range(3))
    d_out = rng.standard_normal((1, 2, 37, 8))
    fn = ac.compile(causal_softcap, backend="interp", cap=5.0)
    _, pullback = fn.vjp(q, k, v)
    grads = pullback(d_out)
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    s = tq @ tk.transpose(-1, -2) * 8**-0.5
    s = 5.0 * torch.tanh(s / 5.0)
    s = s.masked_fill(~torch.ones(37, 37, dtype=torch.bool).tril(), float("-inf"))
    (torch.softmax(s, -1) @ tv).backward(torch.tensor(d_out))
    for got, t in zip(grads, (tq, tk, tv)):
        assert relative_error(got, t.grad.numpy()) < 1e-12


SMALL_TILES = "cse,softmax-fusion,flash-tiling{block_q=16,block_k=32},mask-elimination,canonicalize,cse,dce"


@pytest.mark.parametrize("case", all_cases(), ids=lambda case: case.id)
def test_tiled_backward_with_small_ragged_tiles(case: Case):
    """Many tiles per program, ragged at both ends, skipped and unmasked tiles: the same gradients."""
    _, inputs, cotangents, unfused = pullback_case(case, "")
    _, _, _, tiled = pullback_case(case, SMALL_TILES)
    for g, want in zip(tiled, unfused):
        if want is None:
            assert g is None
        else:
            assert relative_error(g, want) < 1e-10


def test_causal_backward_skips_the_upper_triangle():
    from examples.causal import causal

    text = ac.compile(causal, backend="interp").backward.ir()
    # the query loop of each key block starts at the key block's first query block (j <= i)
    assert "%qb_first = ac.maximum" in text
    assert "ac.switch %tile_class {tile_class = true}" in text
    assert "ac.key_grid {block_k = 64, kv_repeat = 1}" in text


# the cpu backend ------------------------------------------------------------------------------
#: one case of each kind of score and mask: slopes and a table read by the score (their gradients
#: are sites), GQA, an LSE cotangent with an all-masked batch entry, document ids bounded per block,
#: and projections with rotary embeddings around a grouped attention
CPU_CASES = [
    "alibi:causal_alibi[window=40]",
    "relative_bias:relative_bias[max_distance=8]",
    "gqa:grouped_query_attention[KV=2]",
    "lse:key_padding_with_lse",
    "document_mask:causal_document_mask",
    "nanochat_attention:nanochat_attention[n_kv_head=2]",
]


@pytest.mark.parametrize("case", [c for c in all_cases() if c.id in CPU_CASES], ids=lambda case: case.id)
def test_cpu_gradients_match_the_interpreter(case: Case):
    spec, inputs, _ = case.build(np.random.default_rng(0))
    _, _, cotangents, expected = pullback_case(case, "")
    fn = ac.compile(spec, backend="cpu", **case.constants)
    out, pullback = fn.vjp(*inputs)
    assert all(o.dtype == np.float32 for o in as_tuple(out))
    grads = pullback(*(c.astype(np.float32) for c in cotangents))
    for k, (g, want) in enumerate(zip(grads, expected)):
        if want is None:
            assert g is None
            continue
        assert g.dtype == np.asarray(inputs[k]).dtype and g.shape == np.shape(inputs[k])
        assert relative_error(g, want) < 1e-4, f"argument {k}"
    assert "attention_backward_kernel_0" in fn.backward.source


def test_cpu_gradients_with_small_ragged_tiles():
    """16 x 32 tiles over 150 queries and keys: skipped, masked and full tiles, ragged at the end."""
    case = next(c for c in all_cases() if c.id == "alibi:causal_alibi[window=40]")
    spec, inputs, _ = case.build(np.random.default_rng(0))
    _, _, cotangents, expected = pullback_case(case, "")
    fn = ac.compile(spec, backend="cpu", pipeline=SMALL_TILES, **case.constants)
    grads = fn.vjp(*inputs)[1](*(c.astype(np.float32) for c in cotangents))
    for g, want in zip(grads, expected):
        assert relative_error(g, want) < 1e-4


@ac.spec
def infinite_beyond_the_mask(
    q: ac.f32["B", "H", "T", "D"], k: ac.f32["B", "H", "S", "D"], v: ac.f32["B", "H", "S", "E"], slopes: ac.f32["H"]
):
    s = (q @ k.mT) * q.shape[-1] ** -0.5
    b, h, i, j = ac.index(s)
    s = s + slopes[h] / (i - j + 1)  # a division by zero at j = i + 1, where the mask hides it
    return ac.softmax(ac.where(j <= i, s, -ac.inf), axis=-1) @ v


def test_cpu_gradients_where_masked_elements_are_not_finite():
    """The backward selects masked elements away rather than branching around them (the loop
    vectorises): their inf scores and 0 * inf site terms must not reach the slopes' gradient."""
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((1, 2, 40, 8)).astype(np.float32) for _ in range(3))
    slopes = np.array([0.5, -0.25], np.float32)
    d_out = rng.standard_normal((1, 2, 40, 8)).astype(np.float32)
    want = ac.compile(infinite_beyond_the_mask, backend="interp").vjp(q, k, v, slopes)[1](d_out)
    got = ac.compile(infinite_beyond_the_mask, backend="cpu").vjp(q, k, v, slopes)[1](d_out)
    for g, w in zip(got, want):
        assert np.isfinite(g).all() and relative_error(g, w) < 1e-5


@ac.spec
def causal64(q: ac.f64["B", "H", "T", "D"], k: ac.f64["B", "H", "S", "D"], v: ac.f64["B", "H", "S", "E"]):
    s = (q @ k.mT) * q.shape[-1] ** -0.5
    b, h, i, j = ac.index(s)
    return ac.softmax(ac.where(j <= i, s, -ac.inf), axis=-1) @ v


def test_cpu_gradients_in_float64():
    rng = np.random.default_rng(3)
    q, k, v = rng.standard_normal((2, 2, 70, 8)), rng.standard_normal((2, 2, 90, 8)), rng.standard_normal((2, 2, 90, 4))
    d_out = rng.standard_normal((2, 2, 70, 4))
    want = ac.compile(causal64, backend="interp").vjp(q, k, v)[1](d_out)
    got = ac.compile(causal64, backend="cpu").vjp(q, k, v)[1](d_out)
    for g, w in zip(got, want):
        assert g.dtype == np.float64
        assert relative_error(g, w) < 1e-10


def test_cpu_unfused_backward_runs_as_numpy():
    """pipeline="" keeps the graph: its backward (a scatter_add for the slopes) runs in the numpy driver."""
    from examples.alibi import causal_alibi

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 30, 8)).astype(np.float32) for _ in range(3))
    slopes = np.array([0.5, 0.25], np.float32)
    d_out = rng.standard_normal((1, 2, 30, 8))
    want = ac.compile(causal_alibi, backend="interp", pipeline="", window=7).vjp(q, k, v, slopes)[1](d_out)
    fn = ac.compile(causal_alibi, backend="cpu", pipeline="", window=7)
    got = fn.vjp(q, k, v, slopes)[1](d_out.astype(np.float32))
    assert "rt.scatter_add(" in fn.backward.source
    for g, w in zip(got, want):
        assert relative_error(g, w) < 1e-5


@pytest.mark.parametrize("example, spec", [("causal", "causal"), ("sliding_window", "causal_sliding_window")])
def test_backward_skips_the_tiles_the_forward_skips(example: str, spec: str):
    """The backward's block map (key blocks outside, query blocks inside) equals the forward's."""
    from conftest import load_example

    module = load_example(example)
    q, k, v = module.make_inputs(np.random.default_rng(0), T=300, S=300)
    fn = ac.compile(getattr(module, spec), backend="interp")
    out, lse = fn.forward_saving(q, k, v)[-2:]
    forward = fn.block_map(q, k, v)
    backward = fn.backward.block_map(q, k, v, out, lse, np.ones_like(out))
    assert backward.shape == forward.shape == (1, 2, 5, 5)
    assert np.array_equal(backward, forward)
    assert np.count_nonzero(backward[0, 0]) == 15  # the lower triangle of 5 x 5 blocks


def test_deterministic_is_a_no_op_on_the_cpu():
    """The CPU sums in a fixed order already: ``deterministic=True`` marks the IR and changes no kernel."""
    from examples.alibi import causal_alibi

    default = ac.compile(causal_alibi, backend="cpu")
    fn = ac.compile(causal_alibi, backend="cpu", deterministic=True)
    assert "deterministic = true" in fn.backward.ir() and "deterministic" not in default.backward.ir()
    assert fn.backward.source == default.backward.source
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((1, 2, 70, 8)).astype(np.float32) for _ in range(3))
    args = (q, k, v, np.array([0.5, 0.25], np.float32))
    d_out = rng.standard_normal((1, 2, 70, 8)).astype(np.float32)
    for got, want in zip(fn.vjp(*args)[1](d_out), default.vjp(*args)[1](d_out)):
        assert got.tobytes() == want.tobytes()


def test_a_sigmoid_gate_fuses_and_its_gradient_matches_the_interpreter():
    """``ac.sigmoid`` inside the scores: one fused attention on the cpu, its output the formula's
    (``scipy.special.expit``) and every gradient, the gate's included, the interpreter's."""
    from scipy.special import expit

    from tests.passes.specs import sigmoid_gated

    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((1, 2, 37, 8)).astype(np.float32) for _ in range(3))
    gate = np.array([-1.5, 2.0], np.float32)
    fn = ac.compile(sigmoid_gated, backend="cpu")
    assert fn.ir("softmax-fusion").count("ac.attention ") == 1
    s = q.astype(np.float64) @ np.swapaxes(k, -1, -2) / np.sqrt(8) * expit(gate)[None, :, None, None]
    s = np.where(np.tril(np.ones((37, 37), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    want = (p / p.sum(-1, keepdims=True)) @ v
    out, pullback = fn.vjp(q, k, v, gate)
    assert relative_error(out, want) < 1e-5
    d_out = rng.standard_normal(out.shape).astype(np.float32)
    _, reference = ac.compile(sigmoid_gated, backend="interp").vjp(q, k, v, gate)
    for got, expected in zip(pullback(d_out), reference(d_out)):
        assert relative_error(got, expected) < 1e-4
