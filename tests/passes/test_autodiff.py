"""The autodiff pass: every reverse rule against finite differences, and the IR it prints."""

# Dimension names in annotations (ac.f64["T", "D"]) are not forward references.
# ruff: noqa: F821, UP037

import numpy as np
import pytest

import attncomp as ac
from attncomp.passes.adjoints import NO_GRADIENT, RULES
from attncomp.testing import directional_derivatives


@ac.spec
def elementwise(x: ac.f64["T", "D"], y: ac.f64["T", "D"], w: ac.f64["D"]):
    a = ac.abs(x) + ac.log(ac.abs(y) + 1.0) + ac.tanh(x * y) + ac.sqrt(x * x + 1.0) + ac.rsqrt(y * y + 2.0)
    a = a + ac.sigmoid(x - w)
    b = ac.sin(x) * ac.cos(y) - ac.exp(-x * x) / (y * y + 1.0)
    c = ac.maximum(x, y) + ac.minimum(x, w) + (x + 3.0) % (ac.abs(y) + 1.5) + (ac.abs(x) + 1.0) ** (y * 0.5)
    d = ac.where(x > y, x * 2.0, -y) + (x // 1.0) + (-x)
    return a + b + c + d


@ac.spec
def structural(x: ac.f64["B", "T", "D"], w: ac.f64["D", "E"], table: ac.f64[7]):
    h = (x @ w).transpose(0, 2, 1)  # B, E, T
    odd, even = h[..., 1::2], h[..., ::2]
    mixed = ac.concat([odd, even], axis=-1).reshape(h.shape[0], -1)
    t = ac.index(x)[1]
    pick = table[ac.minimum(t, 6)] * x
    return (
        ac.sum(mixed, axis=-1) * ac.mean(mixed, axis=-1),
        ac.max(pick, axis=1),
        ac.min(pick, axis=2, keepdims=True)[..., 0],
        ac.softmax(h, axis=-1),
        ac.logsumexp(h, axis=-1),
    )


@ac.spec
def grouped(x: ac.f64["B", "KV", "S", "D"], c: ac.f64["D"]):
    return ac.repeat_kv(x, 3) * c + (x.astype(ac.f32) * 2.0).astype(ac.f64).sum()


CASES = [
    (elementwise, lambda rng: [rng.standard_normal((5, 4)), rng.standard_normal((5, 4)), rng.standard_normal(4)]),
    (structural, lambda rng: [rng.standard_normal((2, 9, 3)), rng.standard_normal((3, 5)), rng.standard_normal(7)]),
    (grouped, lambda rng: [rng.standard_normal((2, 2, 3, 4)), rng.standard_normal(4)]),
]


@pytest.mark.parametrize("spec, make", CASES, ids=[c[0].name for c in CASES])
def test_every_rule_matches_finite_differences(spec, make):
    rng = np.random.default_rng(0)
    inputs = make(rng)
    out, pullback = ac.compile(spec, backend="interp", pipeline="").vjp(*inputs)
    outs = out if isinstance(out, tuple) else (out,)
    cotangents = [rng.standard_normal(np.shape(o)) for o in outs]
    grads = pullback(*cotangents)
    directions = [rng.standard_normal(np.shape(a)) for a in inputs]
    numeric = directional_derivatives(spec.ir.main, inputs, cotangents, directions)
    for k, (g, d, expected) in enumerate(zip(grads, directions, numeric)):
        assert abs(float(np.sum(g * d)) - expected) <= 1e-6 * max(abs(expected), 1.0), f"argument {k}"


def test_the_rules_cover_every_graph_op():
    from attncomp.ir.ops import OP_DEFS

    graph_ops = {
        name
        for name, op in OP_DEFS.items()
        if not name.startswith("ac.tile")
        and name
        not in (
            "ac.map",
            "ac.switch",
            "ac.key_grid",
            "ac.yield",
            "ac.return",
            "ac.attention_grad",
            "ac.scatter_add",
            "ac.cache_append",
            "ac.page_view",
            "ac.attention",
        )
    }
    assert sorted(graph_ops - set(RULES) - NO_GRADIENT) == []


@ac.spec
def gate(x: ac.f32["N"]):
    return ac.sigmoid(x)


@pytest.mark.parametrize("backend", ["interp", "cpu"])
def test_sigmoid_and_its_gradient_hold_in_both_tails_and_at_zero(backend):
    """``ac.sigmoid`` never overflows: far in either tail its value and gradient are finite and right
    (``1 / (1 + exp(-x))`` gives a NaN gradient below -88 in float32), and at 0 the gradient is 1/4."""
    x = np.array([-1000.0, -100.0, -20.0, -1.5, 0.0, 0.7, 20.0, 100.0, 1000.0], np.float32)
    out, pullback = ac.compile(gate, backend=backend, pipeline="").vjp(x)
    (grad,) = pullback(np.ones_like(out))
    e = np.exp(-np.abs(x.astype(np.float64)))  # sigmoid(x) (1 - sigmoid(x)) = e / (1 + e)^2, stably
    want = np.where(x >= 0, 1 / (1 + e), e / (1 + e))
    assert np.all(np.isfinite(grad))
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-44)
    np.testing.assert_allclose(grad, e / (1 + e) ** 2, rtol=1e-6, atol=1e-44)
    assert grad[4] == 0.25
