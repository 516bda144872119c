"""Gradients (API.md section 5): fn.vjp and fn.backward, derived by the autodiff pass.

Every example spec, unfused and fused: the pullback's gradients against
central finite differences of the float64 interpreter (directional
derivatives along random directions), and every stage of the backward IR,
interpreted, against the unfused graph's gradients.
"""

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
    assert "ac.yield %18, %17, %h_2" in text
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
