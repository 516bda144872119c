"""softmax-fusion: what it recognises, what it refuses and why."""

import ml_dtypes
import numpy as np
import pytest

import attncomp as ac
from attncomp.ir.core import Op
from tests.conftest import example_names, load_example
from tests.passes import specs


def fused_ops(spec, pipeline="cse,softmax-fusion,dce") -> list[Op]:
    fn = ac.compile(spec, backend="interp", pipeline=pipeline)
    return [op for op in ac.parse_ir(fn.ir("final")).main.body.ops if op.name == "ac.attention"], fn


def test_spelled_out_softmax_with_scaled_q_and_repeat_kv_fuses_with_lse():
    (op,), fn = fused_ops(specs.spelled_gqa_lse)
    assert op.attrs["with_lse"] is True
    assert str(op.attrs["kv_repeat"]) == "(H//KV)"
    # k and v are the un-repeated inputs: GQA is an index mapping, not a copy
    assert [v.name for v in op.operands] == ["q", "k", "v"]
    assert "ac.repeat_kv" not in fn.ir("final")
    assert fn.remarks == []


@ac.spec
def spelled_out_with_row_max(q: ac.bf16["H", "T", "D"], k: ac.bf16["H", "S", "D"], v: ac.bf16["H", "S", "D"]):
    s = q @ k.mT * 0.25
    i, j = ac.index(s)[1:]
    s = ac.where(j <= i, s, -ac.inf)
    top = ac.max(s, -1, keepdims=True)  # the softmax's own max, returned too
    e = ac.exp(s - top)
    return (e / ac.sum(e, -1, keepdims=True)) @ v, top, ac.logsumexp(s)


def test_the_scores_row_max_becomes_the_last_result():
    """``ac.max(s, -1)`` of the masked scores (here the spelled-out softmax's own, kept dims, bf16)
    is the fused op's last result (``with_max``), after the log-sum-exp: the same values, each row's
    largest score, as the unfused graph's."""
    (op,), fn = fused_ops(spelled_out_with_row_max)
    assert op.attrs["with_lse"] is True and op.attrs["with_max"] is True and len(op.results) == 3
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 5, 8)).astype(ml_dtypes.bfloat16) for _ in range(3))
    unfused = ac.compile(spelled_out_with_row_max, backend="interp", pipeline="")(q, k, v)
    for got, want in zip(fn(q, k, v), unfused):
        np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64), rtol=1e-2, atol=1e-2)
    top = np.asarray(fn(q, k, v)[1], np.float64)
    assert top.shape == (2, 5, 1) and np.array_equal(top, np.asarray(unfused[1], np.float64))


def test_probabilities_that_are_returned_are_not_fused():
    (ops, fn) = fused_ops(specs.returns_probabilities)
    assert ops == []
    assert fn.remarks == ["softmax-fusion: not fused: the probabilities %p are also returned"]
    q = np.ones((3, 2), np.float32)
    out, p = fn(q, q, q)
    np.testing.assert_allclose(p, np.full((3, 3), 1 / 3), rtol=1e-6)


@ac.spec
def scores_reduced_before_softmax(q: ac.f32["T", "D"], k: ac.f32["S", "D"], v: ac.f32["S", "D"]):
    s = q @ k.mT
    s = s - ac.mean(s, -1, keepdims=True)
    return ac.softmax(s) @ v


def test_a_reduction_inside_the_scores_is_explained():
    ops, fn = fused_ops(scores_reduced_before_softmax)
    assert ops == []
    assert fn.remarks == ["softmax-fusion: not fused: the scores pass through ac.reduce (%1) before the softmax"]


@ac.spec
def scale_in_three_places(q: ac.f32["T", "D"], k: ac.f32["S", "D"], v: ac.f32["S", "D"]):
    s = (q * 0.5) @ (k / 4.0).mT * 2.0
    return ac.softmax(s) @ v


def test_scales_on_q_and_k_move_into_the_score_function():
    (op,), fn = fused_ops(scale_in_three_places)
    assert [v.name for v in op.operands[:2]] == ["q", "k"]
    region_ops = [o.name for o in op.regions[0].ops]
    assert region_ops.count("ac.mul") == 2 and region_ops.count("ac.div") == 1


@ac.spec
def bias_tensor(
    q: ac.f32["B", "T", "D"], k: ac.f32["B", "S", "D"], v: ac.f32["B", "S", "D"], bias: ac.f32["B", "T", "S"]
):
    return ac.softmax(q @ k.mT + bias) @ v


def test_a_captured_score_tensor_is_read_element_by_element():
    (op,), fn = fused_ops(bias_tensor)
    gathers = [o for o in op.regions[0].ops if o.name == "ac.gather"]
    assert len(gathers) == 1 and gathers[0].operands[0].name == "bias"


@pytest.mark.parametrize("name", [n for n in example_names()])
def test_every_example_fuses_and_leaves_no_sequence_by_sequence_buffer(name):
    module = load_example(name)
    for spec in [v for v in vars(module).values() if isinstance(v, ac.Spec)]:
        fn = ac.compile(spec, backend="interp")
        assert fn.remarks == [], spec.name
        fused = [op for op in ac.parse_ir(fn.ir("softmax-fusion")).main.body.ops if op.name == "ac.attention"]
        assert len(fused) == 1, spec.name
        rows, keys = fused[0].operands[0].type.shape[-2], fused[0].operands[1].type.shape[-2]
        final = ac.parse_ir(fn.ir("final")).main
        for op in final.body.walk():
            for value in op.results:
                shape = list(value.type.shape)
                square = rows == keys and shape.count(rows) >= 2
                assert not (square or (rows != keys and rows in shape and keys in shape)), (
                    f"{spec.name}: {value.type} is a sequence-by-sequence buffer"
                )
