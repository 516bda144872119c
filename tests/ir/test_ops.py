"""Every op kind in OP_DEFS, run through the reference interpreter against numpy.

Each spec below uses a few DSL operations; its IR is checked to contain the ops
it is meant to test, and ``ac.interpret`` is compared with a direct numpy
formula in float64.  ``test_every_op_is_covered`` fails when an op kind is
added to ``OP_DEFS`` without a spec or IR text here that uses it.
"""

# Dimension names in annotations (ac.f32["T", "D"]) are not forward references.
# ruff: noqa: F821, UP037

import re

import numpy as np
import pytest

import attncomp as ac
from attncomp.ir.ops import OP_DEFS
from attncomp.passes import PASSES

#: every spec and IR text of this file, for the coverage test
TRACED: list[ac.Spec] = []
IR_TEXTS: list[str] = []


def traced(fn) -> ac.Spec:
    """``@ac.spec``, remembering the spec for the coverage test."""
    spec = ac.spec(fn)
    TRACED.append(spec)
    return spec


def op_names(module) -> set[str]:
    return {op.name for func in module.funcs for op in func.body.walk()}


def assert_same(got, want, atol: float = 0.0, what: str = "result") -> None:
    """Interpreter results against numpy: exact for ints and bools, rtol 1e-12 for floats."""
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    assert len(got) == len(want)
    for k, (g, w) in enumerate(zip(got, want)):
        w = np.asarray(w)
        assert g.shape == w.shape, f"{what} {k}: shape {g.shape}, expected {w.shape}"
        if w.dtype.kind == "f":
            assert g.dtype == np.float64, f"{what} {k}: dtype {g.dtype}"
            np.testing.assert_allclose(g, w, rtol=1e-12, atol=atol, err_msg=f"{what} {k}")
        else:
            assert g.dtype == (np.bool_ if w.dtype == np.bool_ else np.int64), f"{what} {k}: {g.dtype}"
            np.testing.assert_array_equal(g, w, err_msg=f"{what} {k}")


def f64(rng, *shape):
    return rng.standard_normal(shape)


def positive(rng, *shape):
    return rng.uniform(0.5, 3.0, shape)


def nonzero_ints(rng, *shape):
    a = rng.integers(-6, 7, shape)
    return np.where(a == 0, 4, a)


# elementwise arithmetic --------------------------------------------------------------------
@traced
def arith(x: ac.f64["T", "D"], y: ac.f64["D"]):
    return x + y, x - y, x * y, x / y, y - x


def test_add_sub_mul_div_broadcast(rng):
    x, y = f64(rng, 3, 4), positive(rng, 4)
    assert {"ac.add", "ac.sub", "ac.mul", "ac.div"} <= op_names(arith.ir)
    assert_same(ac.interpret(arith, x, y), (x + y, x - y, x * y, x / y, y - x))


@traced
def scalars(x: ac.f64["N"]):
    return 3 + x, x + 0.5, 2.0 - x, x - 1, 2 * x, x * 0.25, 1 / x, x / 4


def test_python_scalars_on_either_side(rng):
    x = positive(rng, 5)
    want = (3 + x, x + 0.5, 2.0 - x, x - 1, 2 * x, x * 0.25, 1 / x, x / 4)
    assert_same(ac.interpret(scalars, x), want)


@traced
def floordiv_mod(x: ac.f64["N"], y: ac.f64["N"], a: ac.i64["N"], b: ac.i64["N"]):
    return x // y, x % y, a // b, a % b, a // 3, 7 // b, -7 % b, a % 4


def test_floordiv_and_mod_round_toward_minus_infinity(rng):
    x, y = 4 * f64(rng, 8), f64(rng, 8)
    a, b = rng.integers(-20, 21, 8), nonzero_ints(rng, 8)
    assert {"ac.floordiv", "ac.mod"} <= op_names(floordiv_mod.ir)
    want = (
        np.floor_divide(x, y),
        np.mod(x, y),
        np.floor_divide(a, b),
        np.mod(a, b),
        np.floor_divide(a, 3),
        np.floor_divide(7, b),
        np.mod(-7, b),
        np.mod(a, 4),
    )
    assert_same(ac.interpret(floordiv_mod, x, y, a, b), want)
    # Python's rule, not C's: the sign of the result follows the divisor
    a1, b1 = np.array([-7, 7, -7, 7]), np.array([2, -2, -2, 2])
    got = ac.interpret(floordiv_mod, a1 * 1.0, b1 * 1.0, a1, b1)
    assert got[2].tolist() == [-4, -4, 3, 3]
    assert got[3].tolist() == [1, -1, -1, 1]


@traced
def powers(x: ac.f64["N"], y: ac.f64["N"], a: ac.i64["N"]):
    return x**2, 2.0**x, x**y, x**-0.5, a**2


def test_pow(rng):
    x, y, a = positive(rng, 6), f64(rng, 6), rng.integers(-4, 5, 6)
    assert "ac.pow" in op_names(powers.ir)
    want = (x**2, 2.0**x, x**y, x**-0.5, a.astype(np.float64) ** 2)
    assert_same(ac.interpret(powers, x, y, a), want)


@traced
def negate_abs(x: ac.f64["N"], a: ac.i64["N"]):
    return -x, abs(x), ac.abs(x), -a, abs(a), +x


def test_neg_and_abs(rng):
    x, a = f64(rng, 6), rng.integers(-9, 10, 6)
    assert {"ac.neg", "ac.abs"} <= op_names(negate_abs.ir)
    assert_same(ac.interpret(negate_abs, x, a), (-x, np.abs(x), np.abs(x), -a, np.abs(a), x))


# comparisons and logic ------------------------------------------------------------------------
@traced
def comparisons(x: ac.f64["N"], y: ac.f64["N"]):
    return x < y, x <= y, x > y, x >= y, x == y, x != y, x > 0.5, 0.5 < x, x == 1


def test_comparisons_give_bools(rng):
    x = rng.integers(0, 3, 10).astype(np.float64)
    y = rng.integers(0, 3, 10).astype(np.float64)
    assert (x == y).any() and (x != y).any()
    want = (x < y, x <= y, x > y, x >= y, x == y, x != y, x > 0.5, 0.5 < x, x == 1)
    assert_same(ac.interpret(comparisons, x, y), want)
    assert {a.attrs["pred"] for a in comparisons.ir.main.body.ops if a.name == "ac.cmp"} == {
        "lt",
        "le",
        "gt",
        "ge",
        "eq",
        "ne",
    }


@traced
def logic(x: ac.f64["N"], y: ac.f64["N"]):
    p, q = x > 0, y > 0
    return p & q, p | q, ~p, ~(p & q) | p, p & True


def test_and_or_not(rng):
    x, y = f64(rng, 12), f64(rng, 12)
    p, q = x > 0, y > 0
    assert {"ac.and", "ac.or", "ac.not"} <= op_names(logic.ir)
    assert_same(ac.interpret(logic, x, y), (p & q, p | q, ~p, ~(p & q) | p, p))


# unary float functions, maximum, minimum, where ----------------------------------------------
@traced
def unary_math(x: ac.f64["N"], p: ac.f64["N"], a: ac.i64["N"]):
    return ac.exp(x), ac.log(p), ac.tanh(x), ac.sqrt(p), ac.rsqrt(p), ac.exp(a), ac.sin(x), ac.cos(x)


def test_exp_log_tanh_sqrt_rsqrt_sin_cos(rng):
    x, p, a = f64(rng, 7), positive(rng, 7), rng.integers(-3, 4, 7)
    assert {"ac.exp", "ac.log", "ac.tanh", "ac.sqrt", "ac.rsqrt", "ac.sin", "ac.cos"} <= op_names(unary_math.ir)
    want = (
        np.exp(x),
        np.log(p),
        np.tanh(x),
        np.sqrt(p),
        1.0 / np.sqrt(p),
        np.exp(a.astype(np.float64)),
        np.sin(x),
        np.cos(x),
    )
    assert_same(ac.interpret(unary_math, x, p, a), want)


@traced
def select(x: ac.f64["T", "S"], y: ac.f64["S"], a: ac.i64["S"]):
    return (
        ac.maximum(x, y),
        ac.minimum(x, 0.0),
        ac.maximum(0, a),
        ac.where(x > y, x, y),
        ac.where(x > 0, x, -ac.inf),
        ac.where(a > 0, 1, a),
    )


def test_maximum_minimum_where(rng):
    x, y, a = f64(rng, 3, 5), f64(rng, 5), rng.integers(-3, 4, 5)
    assert {"ac.maximum", "ac.minimum", "ac.where"} <= op_names(select.ir)
    want = (
        np.maximum(x, y),
        np.minimum(x, 0.0),
        np.maximum(0, a),
        np.where(x > y, x, y),
        np.where(x > 0, x, -np.inf),
        np.where(a > 0, 1, a),
    )
    assert_same(ac.interpret(select, x, y, a), want)


# reductions, softmax, logsumexp ---------------------------------------------------------------
@traced
def reductions(x: ac.f64["A", "B", "C"], a: ac.i64["A", "B"]):
    return (
        ac.max(x, -1),
        ac.min(x, 0),
        ac.sum(x, (0, 2)),
        ac.mean(x, 1, keepdims=True),
        ac.sum(x),
        x.max(axis=(1, -1), keepdims=True),
        x.min(),
        x.mean(-1),
        x.sum(axis=[0, 1]),
        ac.sum(a, 1),
        ac.mean(a),
    )


def test_reductions(rng):
    x, a = f64(rng, 2, 3, 4), rng.integers(-5, 6, (2, 3))
    assert "ac.reduce" in op_names(reductions.ir)
    kinds = {op.attrs["kind"] for op in reductions.ir.main.body.ops if op.name == "ac.reduce"}
    assert kinds == {"max", "min", "sum", "mean"}
    want = (
        x.max(-1),
        x.min(0),
        x.sum((0, 2)),
        x.mean(1, keepdims=True),
        np.asarray(x.sum()),
        x.max((1, 2), keepdims=True),
        np.asarray(x.min()),
        x.mean(-1),
        x.sum((0, 1)),
        a.sum(1),
        np.asarray(a.mean()),
    )
    assert_same(ac.interpret(reductions, x, a), want)


@traced
def softmaxes(x: ac.f64["R", "C"]):
    return ac.softmax(x), ac.softmax(x, axis=0), ac.logsumexp(x), ac.logsumexp(x, axis=0, keepdims=True)


def np_softmax(x: np.ndarray, axis: int) -> np.ndarray:
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def np_logsumexp(x: np.ndarray, axis: int, keepdims: bool = False) -> np.ndarray:
    m = x.max(axis=axis, keepdims=True)
    out = m + np.log(np.exp(x - m).sum(axis=axis, keepdims=True))
    return out if keepdims else np.squeeze(out, axis)


def test_softmax_and_logsumexp(rng):
    x = 3 * f64(rng, 4, 5)
    assert {"ac.softmax", "ac.logsumexp"} <= op_names(softmaxes.ir)
    want = (np_softmax(x, -1), np_softmax(x, 0), np_logsumexp(x, -1), np_logsumexp(x, 0, keepdims=True))
    assert_same(ac.interpret(softmaxes, x), want)


def test_softmax_of_a_fully_masked_row_is_zero_and_its_logsumexp_is_minus_inf(rng):
    x = f64(rng, 3, 4)
    x[1, :] = -np.inf  # every key masked
    x[2, :2] = -np.inf  # some keys masked
    p, p0, lse, lse0 = ac.interpret(softmaxes, x)
    assert not np.isnan(p).any() and not np.isnan(lse).any()
    np.testing.assert_array_equal(p[1], np.zeros(4))
    assert lse[1] == -np.inf
    live = x[[0, 2]]
    np.testing.assert_allclose(p[[0, 2]], np_softmax(live, -1), rtol=1e-12)
    np.testing.assert_allclose(lse[[0, 2]], np_logsumexp(live, -1), rtol=1e-12)
    np.testing.assert_array_equal(p[2, :2], [0.0, 0.0])
    # along axis 0 every column still has finite entries
    np.testing.assert_allclose(p0, np_softmax(x, 0), rtol=1e-12)
    np.testing.assert_allclose(lse0, np_logsumexp(x, 0, keepdims=True), rtol=1e-12)


# positions and gathers ---------------------------------------------------------------------------
@traced
def positions(s: ac.f64["B", "H", "T", "S"]):
    b, h, i, j = ac.index(s)
    return b, h, i, j, j - i, s + i


def test_index_gives_broadcastable_positions(rng):
    s = f64(rng, 2, 3, 4, 5)
    assert "ac.iota" in op_names(positions.ir)
    b = np.arange(2).reshape(2, 1, 1, 1)
    h = np.arange(3).reshape(1, 3, 1, 1)
    i = np.arange(4).reshape(1, 1, 4, 1)
    j = np.arange(5).reshape(1, 1, 1, 5)
    assert_same(ac.interpret(positions, s), (b, h, i, j, j - i, s + i))


@traced
def gathers(
    s: ac.f64["B", "H", "T", "S"],
    slopes: ac.f64["H"],
    doc: ac.i64["B", "T"],
    table: ac.f64["V"],
    ids: ac.i64["N"],
):
    b, h, i, j = ac.index(s)
    return slopes[h], doc[b, i], s + slopes[h] * (j - i), table[ids], table[ids // 2]


def test_gathers(rng):
    s, slopes = f64(rng, 2, 3, 4, 5), f64(rng, 3)
    doc = rng.integers(0, 3, (2, 4))
    table, ids = f64(rng, 6), rng.integers(0, 6, 9)
    assert "ac.gather" in op_names(gathers.ir)
    i, j = np.arange(4).reshape(4, 1), np.arange(5)
    want = (
        slopes.reshape(1, 3, 1, 1),
        doc.reshape(2, 1, 4, 1),
        s + slopes.reshape(1, 3, 1, 1) * (j - i),
        table[ids],
        table[ids // 2],
    )
    assert_same(ac.interpret(gathers, s, slopes, doc, table, ids), want)


@pytest.mark.parametrize("bad, message", [(6, "index 6 is out of range"), (-1, "index -1 is out of range")])
def test_gather_out_of_range_raises_index_error(rng, bad, message):
    ids = np.array([0, 5, bad, 2])
    args = (f64(rng, 1, 1, 1, 1), f64(rng, 1), np.zeros((1, 1), np.int64), f64(rng, 6), ids)
    # the spec's file and line, the interpreter's message, then the line's source
    with pytest.raises(IndexError, match=rf"^\S+test_ops.py:\d+: ac.gather: {message} for axis 0 of size 6\n    \S"):
        ac.interpret(gathers, *args)


# slices, reshapes, transposes ---------------------------------------------------------------
@traced
def slices(x: ac.f64["T", "D"]):
    half = x.shape[-1] // 2
    return (
        x[..., 1:3],
        x[..., :half],
        x[..., half:],
        x[:, 0],
        x[None],
        x[..., -2:],
        x[..., ::2],
        x[1:, ::3],
        x[:, -1],
        x[..., 1:-1],
        x[0],
        x[:, None, 2:4],
        x[..., 3],
    )


def test_slicing(rng):
    x = f64(rng, 5, 6)
    assert {"ac.slice", "ac.reshape"} <= op_names(slices.ir)
    want = (
        x[..., 1:3],
        x[..., :3],
        x[..., 3:],
        x[:, 0],
        x[None],
        x[..., -2:],
        x[..., ::2],
        x[1:, ::3],
        x[:, -1],
        x[..., 1:-1],
        x[0],
        x[:, None, 2:4],
        x[..., 3],
    )
    assert_same(ac.interpret(slices, x), want)


@pytest.mark.parametrize("shape", [(4, 7), (2, 4), (6, 5)])
def test_slicing_is_shape_generic(rng, shape):
    # the same spec at other sizes (its constant bounds need T >= 2 and D >= 4)
    x = f64(rng, *shape)
    got = ac.interpret(slices, x)
    half = shape[1] // 2
    assert_same(got[1:3] + (got[6], got[7]), (x[..., :half], x[..., half:], x[..., ::2], x[1:, ::3]))


@traced
def fixed_slices(y: ac.f64[4, 6]):
    return y[1:100], y[-3:], y[::3, 5:], y[-10:, :100], y[1:-1:2, -1]


def test_slicing_fixed_sizes_clamps_like_numpy(rng):
    y = f64(rng, 4, 6)
    assert str(fixed_slices.ir.main.result_types[3]) == "tensor<4 x 6 x f64>"
    want = (y[1:100], y[-3:], y[::3, 5:], y[-10:, :100], y[1:-1:2, -1])
    assert_same(ac.interpret(fixed_slices, y), want)


@traced
def reshapes(x: ac.f64["T", "D"], y: ac.f64[4, "D"]):
    t, d = x.shape
    return x.reshape(-1), x.reshape(t, 2, d // 2), x.reshape((t * d,)), y.reshape(2, -1), x.reshape(t, d, 1)


def test_reshape(rng):
    x, y = f64(rng, 3, 6), f64(rng, 4, 6)
    types = [str(t) for t in reshapes.ir.main.result_types]
    assert types == [
        "tensor<(D*T) x f64>",
        "tensor<T x 2 x (D//2) x f64>",
        "tensor<(D*T) x f64>",
        "tensor<2 x (2*D) x f64>",
        "tensor<T x D x 1 x f64>",
    ]
    want = (x.reshape(-1), x.reshape(3, 2, 3), x.reshape(18), y.reshape(2, -1), x.reshape(3, 6, 1))
    assert_same(ac.interpret(reshapes, x, y), want)


def test_reshape_whose_sizes_do_not_fit_is_a_shape_error(rng):
    with pytest.raises(ac.ShapeError, match=r"sizes D = 5, T = 3 do not fit the spec"):
        ac.interpret(reshapes, f64(rng, 3, 5), f64(rng, 4, 5))


@traced
def transposes(x: ac.f64["A", "B", "C"], m: ac.f64["R", "K"]):
    return (
        x.transpose(2, 0, 1),
        x.transpose(1, 2),
        x.transpose((1, 0, 2)),
        x.mT,
        x.T,
        m.mT,
        m.T,
        x.transpose(-1, 0),
    )


def test_transpose(rng):
    x, m = f64(rng, 2, 3, 4), f64(rng, 3, 5)
    assert "ac.transpose" in op_names(transposes.ir)
    want = (
        np.transpose(x, (2, 0, 1)),
        np.swapaxes(x, 1, 2),
        np.transpose(x, (1, 0, 2)),
        np.swapaxes(x, -1, -2),
        x.T,
        m.T,
        m.T,
        np.swapaxes(x, -1, 0),
    )
    assert_same(ac.interpret(transposes, x, m), want)


# concat, repeat_kv, cast, matmul --------------------------------------------------------------
@traced
def concats(x: ac.f64["T", "D"], y: ac.f64["T", "E"]):
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return ac.concat([-x2, x1], axis=-1), ac.concat([x, y, x], axis=1), ac.concat((x, x), axis=0)


def test_concat(rng):
    x, y = f64(rng, 3, 5), f64(rng, 3, 2)
    types = [str(t) for t in concats.ir.main.result_types]
    assert types == ["tensor<T x D x f64>", "tensor<T x (2*D+E) x f64>", "tensor<(2*T) x D x f64>"]
    want = (
        np.concatenate([-x[:, 2:], x[:, :2]], axis=-1),
        np.concatenate([x, y, x], axis=1),
        np.concatenate([x, x], axis=0),
    )
    assert_same(ac.interpret(concats, x, y), want)


@traced
def repeats(k: ac.f64["B", "KV", "S", "D"], q: ac.f64["B", "H", "T", "D"]):
    return ac.repeat_kv(k, 3), ac.repeat_kv(k, q.shape[1] // k.shape[1]), ac.repeat_kv(k, 1)


def test_repeat_kv(rng):
    k, q = f64(rng, 1, 2, 3, 4), f64(rng, 1, 6, 2, 4)
    types = [str(t) for t in repeats.ir.main.result_types]
    assert types[:2] == ["tensor<B x (3*KV) x S x D x f64>", "tensor<B x (KV*(H//KV)) x S x D x f64>"]
    got = ac.interpret(repeats, k, q)
    assert_same(got, (np.repeat(k, 3, axis=1), np.repeat(k, 3, axis=1), k))
    # head h of the result is head h // n_rep of k
    np.testing.assert_array_equal(got[0][:, 4], k[:, 1])


@traced
def casts(x: ac.f64["N"], a: ac.i64["N"]):
    return x.astype(ac.i64), x.astype(ac.bool_), a.astype(ac.f32), a.astype("f64"), (x > 0).astype(ac.f32)


def test_astype(rng):
    x, a = 3 * f64(rng, 8), rng.integers(-5, 6, 8)
    x[0] = 0.0
    assert "ac.cast" in op_names(casts.ir)
    want = (
        x.astype(np.int64),
        x != 0,
        a.astype(np.float64),
        a.astype(np.float64),
        (x > 0).astype(np.float64),
    )
    assert_same(ac.interpret(casts, x, a), want)


@traced
def matmuls(a: ac.f64["B", "H", "T", "D"], b: ac.f64["H", "D", "S"], m: ac.f64["T", "D"], n: ac.i64["D", "S"]):
    return a @ b, m @ b, m @ n, m @ m.mT


def test_matmul_broadcasts_batch_axes(rng):
    a, b, m = f64(rng, 2, 3, 4, 5), f64(rng, 3, 5, 6), f64(rng, 4, 5)
    n = rng.integers(-3, 4, (5, 6))
    assert "ac.matmul" in op_names(matmuls.ir)
    types = [str(t) for t in matmuls.ir.main.result_types]
    assert types == [
        "tensor<B x H x T x S x f64>",
        "tensor<H x T x S x f64>",
        "tensor<T x S x f64>",
        "tensor<T x T x f64>",
    ]
    assert_same(ac.interpret(matmuls, a, b, m, n), (a @ b, m @ b, m @ n, m @ m.T))


# sizes and constants as values -------------------------------------------------------------------
@traced
def sizes(x: ac.f64["T", "D"]):
    t, d = x.shape
    return x * d + t, x / (t * d), x * d**-0.5, x + (d - d // 2), x * 2, x + True * 1.5


def test_sizes_and_constants_as_values(rng):
    x = f64(rng, 3, 5)
    assert {"ac.dim", "ac.constant"} <= op_names(sizes.ir)
    want = (x * 5 + 3, x / 15, x * 5**-0.5, x + 3, x * 2, x + 1.5)
    assert_same(ac.interpret(sizes, x), want)


# fused attention with regions, and ac.yield ---------------------------------------------------------
ATTENTION_IR = """\
ac.func @alibi(%q: tensor<B x H x T x D x f64>, %k: tensor<B x H x S x D x f64>, \
%v: tensor<B x H x S x E x f64>, %slopes: tensor<H x f64>) -> \
(tensor<B x H x T x E x f64>, tensor<B x H x T x f64>) {
  %scale = ac.constant {value = 0.5} : tensor<f64>
  %out, %lse = ac.attention %q, %k, %v {kv_repeat = 1, with_lse = true} : \
tensor<B x H x T x E x f64>, tensor<B x H x T x f64> ({
  ^bb0(%b: tensor<i64>, %h: tensor<i64>, %i: tensor<i64>, %j: tensor<i64>, %s: tensor<f64>):
    %0 = ac.mul %s, %scale : tensor<f64>
    %1 = ac.gather %slopes, %h : tensor<f64>
    %2 = ac.sub %j, %i : tensor<i64>
    %3 = ac.mul %1, %2 : tensor<f64>
    %4 = ac.add %0, %3 : tensor<f64>
    ac.yield %4
  }, {
  ^bb0(%b_1: tensor<i64>, %h_1: tensor<i64>, %i_1: tensor<i64>, %j_1: tensor<i64>):
    %visible = ac.cmp %j_1, %i_1 {pred = "le"} : tensor<i1>
    ac.yield %visible
  })
  ac.return %out, %lse
}
"""
IR_TEXTS.append(ATTENTION_IR)

GQA_ATTENTION_IR = """\
ac.func @gqa(%q: tensor<B x H x T x D x f64>, %k: tensor<B x KV x S x D x f64>, \
%v: tensor<B x KV x S x D x f64>) -> tensor<B x H x T x D x f64> {
  %out = ac.attention %q, %k, %v {kv_repeat = (H//KV), with_lse = false} : tensor<B x H x T x D x f64> ({
  ^bb0(%b: tensor<i64>, %h: tensor<i64>, %i: tensor<i64>, %j: tensor<i64>, %s: tensor<f64>):
    ac.yield %s
  }, {
  ^bb0(%b_1: tensor<i64>, %h_1: tensor<i64>, %i_1: tensor<i64>, %j_1: tensor<i64>):
    %0 = ac.sub %i_1, %j_1 : tensor<i64>
    %1 = ac.constant {value = 2} : tensor<i64>
    %2 = ac.cmp %0, %1 {pred = "lt"} : tensor<i1>
    ac.yield %2
  })
  ac.return %out
}
"""
IR_TEXTS.append(GQA_ATTENTION_IR)


def np_attention(q, k, v, visible, scores_fn=lambda s: s):
    s = np.where(visible, scores_fn(q @ np.swapaxes(k, -1, -2)), -np.inf)
    m = s.max(-1, keepdims=True)
    m = np.where(np.isneginf(m), 0.0, m)
    e = np.exp(s - m)
    total = e.sum(-1, keepdims=True)
    with np.errstate(divide="ignore"):
        lse = np.squeeze(m + np.log(total), -1)
    return (e @ v) / np.where(total == 0, 1.0, total), lse


def test_attention_runs_its_score_and_mask_regions(rng):
    module = ac.parse_ir(ATTENTION_IR)
    assert str(module) == ATTENTION_IR
    q, k, v = f64(rng, 2, 3, 4, 5), f64(rng, 2, 3, 6, 5), f64(rng, 2, 3, 6, 2)
    slopes = f64(rng, 3)
    i, j = np.arange(4).reshape(4, 1), np.arange(6)
    alibi = slopes.reshape(3, 1, 1) * (j - i)
    want = np_attention(q, k, v, j <= i, lambda s: s * 0.5 + alibi)
    assert_same(ac.interpret(module, q, k, v, slopes), want)


def test_attention_of_a_query_with_no_visible_key_gives_zeros_and_minus_inf(rng):
    text = ATTENTION_IR.replace('{pred = "le"}', '{pred = "lt"}')  # query 0 sees nothing
    q, k, v = f64(rng, 1, 3, 4, 5), f64(rng, 1, 3, 4, 5), f64(rng, 1, 3, 4, 2)
    out, lse = ac.interpret(ac.parse_ir(text), q, k, v, f64(rng, 3))
    np.testing.assert_array_equal(out[:, :, 0], 0.0)
    np.testing.assert_array_equal(lse[:, :, 0], -np.inf)
    assert np.isfinite(out).all() and np.isfinite(lse[:, :, 1:]).all()


def test_attention_with_grouped_heads(rng):
    module = ac.parse_ir(GQA_ATTENTION_IR)
    q, k, v = f64(rng, 1, 6, 5, 4), f64(rng, 1, 2, 5, 4), f64(rng, 1, 2, 5, 4)
    i, j = np.arange(5).reshape(5, 1), np.arange(5)
    want, _ = np_attention(q, np.repeat(k, 3, axis=1), np.repeat(v, 3, axis=1), i - j < 2)
    assert_same(ac.interpret(module, q, k, v), want)
    with pytest.raises(ac.ShapeError, match="sizes H = 6, KV = 4 do not fit the spec"):
        ac.interpret(module, q, f64(rng, 1, 4, 5, 4), f64(rng, 1, 4, 5, 4))


# every stage of the attention pipeline -------------------------------------------------------------
#: the standard passes, with small tiles so that the test sizes span several
PIPELINE = ["softmax-fusion", "flash-tiling{block_q=2,block_k=3}", "mask-elimination"]


def pipeline() -> str:
    return ",".join(p for p in PIPELINE if p.partition("{")[0] in PASSES)


@traced
def gqa_alibi(
    q: ac.f64["B", "H", "T", "D"],
    k: ac.f64["B", "KV", "S", "D"],
    v: ac.f64["B", "KV", "S", "E"],
    slopes: ac.f64["H"],
    *,
    window: int = 3,
):
    n_rep = q.shape[1] // k.shape[1]
    k, v = ac.repeat_kv(k, n_rep), ac.repeat_kv(v, n_rep)
    s = (q @ k.mT) * q.shape[-1] ** -0.5
    b, h, i, j = ac.index(s)
    s = s + slopes[h] * (j - i)
    s = ac.where((j <= i) & (i - j < window), s, -ac.inf)
    return ac.softmax(s, axis=-1) @ v, ac.logsumexp(s, axis=-1)


def np_gqa_alibi(q, k, v, slopes, window=3):
    n_rep = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, n_rep, axis=1), np.repeat(v, n_rep, axis=1)
    i, j = np.arange(q.shape[2]).reshape(-1, 1), np.arange(k.shape[2])
    alibi = slopes.reshape(-1, 1, 1) * (j - i)
    return np_attention(q, k, v, (j <= i) & (i - j < window), lambda s: s / np.sqrt(q.shape[-1]) + alibi)


@traced
def spelled_out(q: ac.f64["B", "T", "D"], k: ac.f64["B", "S", "D"], v: ac.f64["B", "S", "D"]):
    s = q @ k.mT
    e = ac.exp(s - ac.max(s, -1, keepdims=True))
    p = e / ac.sum(e, -1, keepdims=True)
    return p @ v


@traced
def documents(
    q: ac.f64["B", "H", "T", "D"],
    k: ac.f64["B", "H", "T", "D"],
    v: ac.f64["B", "H", "T", "E"],
    doc: ac.i64["B", "T"],
):
    s = q @ k.mT
    b, h, i, j = ac.index(s)
    s = ac.where((doc[b, i] == doc[b, j]) & (j <= i), s, -ac.inf)
    return ac.softmax(s) @ v


def np_documents(q, k, v, doc):
    i, j = np.arange(q.shape[2]).reshape(-1, 1), np.arange(k.shape[2])
    same = doc[:, None, :, None] == doc[:, None, None, :]
    return np_attention(q, k, v, same & (j <= i))[0]


def pipeline_cases(rng):
    q, k, v = f64(rng, 2, 4, 7, 3), f64(rng, 2, 2, 8, 3), f64(rng, 2, 2, 8, 2)
    slopes = f64(rng, 4)
    yield gqa_alibi, (q, k, v, slopes), np_gqa_alibi(q, k, v, slopes)
    q, k, v = f64(rng, 2, 5, 3), f64(rng, 2, 7, 3), f64(rng, 2, 7, 3)
    yield spelled_out, (q, k, v), np_attention(q, k, v, True)[0]
    q, k, v = f64(rng, 2, 1, 9, 3), f64(rng, 2, 1, 9, 3), f64(rng, 2, 1, 9, 2)
    doc = np.array([[0, 0, 0, 0, 1, 1, 2, 2, 2], [0, 1, 1, 1, 1, 1, 1, 1, 3]])
    yield documents, (q, k, v, doc), np_documents(q, k, v, doc)


def compiled_stages(spec):
    fn = ac.compile(spec, backend="interp", pipeline=pipeline())
    return fn, [(stage, ac.parse_ir(fn.ir(stage))) for stage in ["input", *fn.stages]]


def test_every_stage_of_the_pipeline_matches_numpy(rng):
    for spec, args, want in pipeline_cases(rng):
        fn, stages = compiled_stages(spec)
        for stage, module in stages:
            # online softmax reorders the sums: near-zero outputs need an absolute bound too
            assert_same(ac.interpret(module, *args), want, atol=1e-12, what=f"{spec.name} after {stage}")
        assert_same(fn(*args), want, atol=1e-12, what=f"{spec.name} compiled")


# decoding: ac.cache_append ---------------------------------------------------------------------
@traced
def attend(q: ac.f64["B", "H", "T", "D"], k: ac.f64["B", "H", "T", "D"], v: ac.f64["B", "H", "T", "D"]):
    s = q @ k.mT
    b, h, i, j = ac.index(s)
    return ac.softmax(ac.where(j <= i, s, -ac.inf)) @ v


def decoder_module():
    decoder = ac.compile(attend, backend="interp").decoder(max_len=8)
    return decoder, ac.parse_ir(decoder.fn.ir("kv-cache-reuse"))


def test_cache_append_is_the_cached_prefix_then_the_new_entries(rng):
    decoder, module = decoder_module()
    assert "ac.cache_append" in op_names(module)
    q, k, v = (rng.standard_normal((1, 2, 3, 4)) for _ in range(3))
    cache_k, cache_v = (rng.standard_normal((1, 2, 8, 4)) for _ in range(2))
    out, new_k, new_v = ac.interpret(module, q, k, v, cache_k, cache_v, sizes={"N_cached": 5})
    keys = np.concatenate([cache_k[:, :, :5], k], axis=2)
    values = np.concatenate([cache_v[:, :, :5], v], axis=2)
    s = q @ np.swapaxes(keys, -1, -2)
    s = np.where(np.arange(8)[None, :] <= np.arange(5, 8)[:, None], s, -np.inf)  # absolute query positions 5..7
    p = np.exp(s - s.max(-1, keepdims=True))
    assert_same((out, new_k, new_v), (p / p.sum(-1, keepdims=True) @ values, k, v))


# serving: ac.page_view -----------------------------------------------------------------------------
PAGE_VIEW_IR = """\
ac.func @pages(%pages: tensor<P x KV x S x D x f64>, %table: tensor<B x N x i64>) -> tensor<B x KV x R x D x f64> {
  %0 = ac.page_view %pages, %table {rows = R} : tensor<B x KV x R x D x f64>
  ac.return %0
}
"""
IR_TEXTS.append(PAGE_VIEW_IR)


def test_page_view_reads_each_row_through_its_sequence_table(rng):
    module = ac.parse_ir(PAGE_VIEW_IR)
    assert str(module) == PAGE_VIEW_IR
    pages = rng.standard_normal((6, 2, 4, 3))  # 6 pages, 2 heads of 4 rows of 3 channels
    table = np.array([[5, 0, 3], [2, 2, 1]])
    view = ac.interpret(module, pages, table, sizes={"R": 10})
    for b in range(2):
        for r in range(10):
            assert_same(view[b, :, r], pages[table[b, r // 4], :, r % 4])
    with pytest.raises(IndexError, match="13 rows need 4 pages of 4, the table has 3"):
        ac.interpret(module, pages, table, sizes={"R": 13})
    with pytest.raises(IndexError, match="page 6 is out of range for a pool of 6 pages"):
        ac.interpret(module, pages, table + 1, sizes={"R": 10})


PAGE_SLOT_IR = """\
ac.func @pages(%pages: tensor<P x S x KV x D x f64>, %table: tensor<N x i32>) -> tensor<1 x KV x R x D x f64> {
  %0 = ac.page_view %pages, %table {rows = R, slot = 1} : tensor<1 x KV x R x D x f64>
  ac.return %0
}
"""
IR_TEXTS.append(PAGE_SLOT_IR)


def test_page_view_of_pages_holding_a_rows_heads_together(rng):
    """``slot = 1``: pages ``[num_pages, P, KV, D]`` (FlashAttention's layout), one table for one
    sequence: the same ``[1, KV, rows, D]`` view; 8-bit pages and other axes refused."""
    module = ac.parse_ir(PAGE_SLOT_IR)
    assert str(module) == PAGE_SLOT_IR
    pages = rng.standard_normal((5, 4, 2, 3))  # 5 pages of 4 rows, each row 2 heads of 3 channels
    table = np.array([4, 1, 3], np.int32)
    view = ac.interpret(module, pages, table, sizes={"R": 11})
    assert view.shape == (1, 2, 11, 3)
    for r in range(11):
        assert_same(view[0, :, r], pages[table[r // 4], r % 4])
    with pytest.raises(ac.VerifyError, match="slot is 1 or 2"):
        ac.parse_ir(PAGE_SLOT_IR.replace("slot = 1", "slot = 3"))
    with pytest.raises(ac.VerifyError, match="8-bit pages hold a page's rows after the heads"):
        text = PAGE_SLOT_IR.replace("%table: tensor<N x i32>", "%table: tensor<N x i32>, %s: tensor<P x S x KV x f32>")
        text = text.replace("D x f64>, %table", "D x f8e4m3>, %table")
        ac.parse_ir(text.replace("%pages, %table {", "%pages, %table, %s {"))


RANDOM_IR = """\
ac.func @draws(%seed: tensor<i64>, %rows: tensor<T x 1 x i32>, %cols: tensor<1 x S x i64>) -> tensor<T x S x f32> {
  %0 = ac.random %seed, %rows, %cols : tensor<T x S x f32>
  ac.return %0
}
"""
IR_TEXTS.append(RANDOM_IR)


def test_random_hashes_its_counters_into_float32_in_zero_to_one():
    from attncomp.ir.ops.random import uniform

    module = ac.parse_ir(RANDOM_IR)
    assert str(module) == RANDOM_IR
    rows, cols = np.arange(5, dtype=np.int32)[:, None], np.arange(7)[None, :]
    draws = ac.interpret(module, np.int64(3), rows, cols)
    assert draws.shape == (5, 7) and np.all((0 <= draws) & (draws < 1))
    assert_same(draws, uniform(np.int64(3), rows.astype(np.int64), cols))  # the counters' type does not count
    assert not np.array_equal(draws, ac.interpret(module, np.int64(4), rows, cols))
    with pytest.raises(ac.VerifyError, match="ac.random: operands must be integer tensors, got f32"):
        ac.parse_ir(RANDOM_IR.replace("%seed: tensor<i64>", "%seed: tensor<f32>"))


# coverage ---------------------------------------------------------------------------------------
def test_every_op_is_covered():
    covered = op_names(decoder_module()[1])
    for spec in TRACED:
        covered |= op_names(spec.ir)
    for text in IR_TEXTS:
        covered |= op_names(ac.parse_ir(text))
    for spec, _, _ in pipeline_cases(np.random.default_rng(0)):
        for _, module in compiled_stages(spec)[1]:
            covered |= op_names(module)
        for graph in ("", None):  # backwards: ac.scatter_add unfused; ac.attention_grad, then ac.key_grid, fused
            backward = ac.compile(spec, backend="interp", pipeline=graph).backward
            covered |= op_names(ac.parse_ir(backward.ir("autodiff"))) | op_names(ac.parse_ir(backward.ir()))
    assert sorted(set(OP_DEFS) - covered) == []
    assert sorted(covered) == sorted(OP_DEFS)


# element types in the printed IR -------------------------------------------------------------------
@ac.spec
def promotions(x: ac.f32["T"], a: ac.i64["T"], b: ac.i32["T"], h: ac.f16["T"], y: ac.f64["T"]):
    return (
        x * 0.5,
        2.0 * x,
        x * 2,
        a / 2,
        x < a,
        a + b,
        x + y,
        h * 2.0,
        ac.exp(a),
        ac.mean(a),
        a // 2,
        a**2,
        (x > 0) & (a > 1),
        x + a,
        b * 3,
        x * x.shape[0] ** -0.5,
    )


def test_dtype_promotion_in_printed_types():
    text = str(promotions.ir)
    header = text.splitlines()[0]
    results = re.search(r"-> \((.*)\) \{$", header).group(1).split(", ")
    assert results == [
        "tensor<T x f32>",  # f32 tensor * python float stays f32
        "tensor<T x f32>",
        "tensor<T x f32>",
        "tensor<T x f32>",  # int tensor / int gives a float
        "tensor<T x i1>",  # comparisons give i1
        "tensor<T x i64>",  # the wider int
        "tensor<T x f64>",  # the wider float
        "tensor<T x f16>",
        "tensor<T x f32>",  # exp of ints gives a float
        "tensor<f32>",  # mean of ints gives a float
        "tensor<T x i64>",
        "tensor<T x f32>",  # ** always gives a float
        "tensor<T x i1>",
        "tensor<T x f32>",  # float beats int
        "tensor<T x i32>",  # a python int does not widen i32
        "tensor<T x f32>",  # the 0-d f64 scale does not widen f32
    ]
    assert "%7 = ac.div %a, %6 : tensor<T x f32>" in text
    assert re.search(r"= ac.cmp %x, %a \{pred = \"lt\"\} : tensor<T x i1>", text)


CHECK_INDEX_IR = """\
ac.func @checked(%table: tensor<R x f32>, %lo: tensor<i64>, %hi: tensor<i64>) -> tensor<R x f32> {
  %n = ac.dim {value = (2*R)} : tensor<i64>
  ac.check_index %lo, %hi, %n {at = "", axis = 0, exact = true, size = R}
  ac.return %table
}
"""
IR_TEXTS.append(CHECK_INDEX_IR)


def test_check_index_passes_in_range_and_raises_out_of_it():
    module = ac.parse_ir(CHECK_INDEX_IR)
    assert str(module) == CHECK_INDEX_IR  # prints back, and dce-free parsing keeps it
    table = np.arange(5.0, dtype=np.float32)
    assert_same(ac.interpret(module, table, np.array(0), np.array(4)), table)
    with pytest.raises(IndexError, match=r"^ac.gather: index 5 is out of range for axis 0 of size 5$"):
        ac.interpret(module, table, np.array(1), np.array(5))
    with pytest.raises(IndexError, match=r"^ac.gather: index -2 is out of range for axis 0 of size 5$"):
        ac.interpret(module, table, np.array(-2), np.array(7))
    inexact = ac.parse_ir(CHECK_INDEX_IR.replace("exact = true", "exact = false"))
    with pytest.raises(IndexError, match=r"^ac.gather: an index may reach 7, out of range for axis 0 of size 5"):
        ac.interpret(inexact, table, np.array(0), np.array(7))
    from attncomp.ir.graph import remove_dead_ops

    body = ac.parse_ir(CHECK_INDEX_IR).main.body
    remove_dead_ops(body)
    assert [op.name for op in body.ops] == ["ac.dim", "ac.check_index", "ac.return"]  # a check is live
