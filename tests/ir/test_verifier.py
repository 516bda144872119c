"""The verifier: malformed IR is reported with the op, its line, and the lines around it."""

# Dimension names in annotations (ac.f32["T", "D"]) are not forward references.
# ruff: noqa: F821, UP037

import numpy as np
import pytest

import attncomp as ac
from attncomp.ir.verifier import verify_module


@ac.spec
def f(x: ac.f32["T", "D"], y: ac.f32["T", "D"]):
    s = x + y
    return ac.exp(s) * 2.0


TEXT = """\
ac.func @f(%x: tensor<T x D x f32>, %y: tensor<T x D x f32>) -> tensor<T x D x f32> {
  %s = ac.add %x, %y : tensor<T x D x f32>
  %0 = ac.exp %s : tensor<T x D x f32>
  %1 = ac.constant {value = 2.0} : tensor<f32>
  %out = ac.mul %0, %1 : tensor<T x D x f32>
  ac.return %out
}
"""
LINES = TEXT.splitlines()


def test_base_text_is_the_spec_ir():
    assert str(f.ir) == TEXT
    verify_module(ac.parse_ir(TEXT))


def listing(marked: int, lines: list[str], first: int, last: int) -> str:
    """Lines ``first..last`` (1-based) of ``lines`` as the verifier reprints them."""
    return "\n".join(("> " if k == marked else "  ") + f"{k:4d} | {lines[k - 1]}" for k in range(first, last + 1))


def verify_error(text: str) -> str:
    with pytest.raises(ac.VerifyError) as info:
        ac.parse_ir(text)
    return str(info.value)


def test_wrong_result_type():
    text = TEXT.replace("%0 = ac.exp %s : tensor<T x D x f32>", "%0 = ac.exp %s : tensor<T x D x f64>")
    message = verify_error(text)
    head = "line 3: @f: ac.exp: result types should be tensor<T x D x f32>, not tensor<T x D x f64>"
    assert message == head + "\n" + listing(3, text.splitlines(), 1, 5)


def test_wrong_result_shape():
    text = TEXT.replace("%s = ac.add %x, %y : tensor<T x D x f32>", "%s = ac.add %x, %y : tensor<D x T x f32>")
    message = verify_error(text)
    head = "line 2: @f: ac.add: result types should be tensor<T x D x f32>, not tensor<D x T x f32>"
    assert message == head + "\n" + listing(2, text.splitlines(), 1, 4)


def test_unknown_op():
    text = TEXT.replace("ac.exp", "ac.expo")
    message = verify_error(text)
    assert message == "line 3: @f: unknown op 'ac.expo'\n" + listing(3, text.splitlines(), 1, 5)


def test_type_rule_failure_names_the_dimensions():
    text = TEXT.replace("%y: tensor<T x D x f32>", "%y: tensor<T x E x f32>")
    message = verify_error(text)
    head = "line 2: @f: ac.add: shapes (T, D) and (T, E) cannot broadcast: D against E on axis -1"
    assert message == head + "\n" + listing(2, text.splitlines(), 1, 4)


def test_wrong_operand_count():
    text = TEXT.replace("ac.exp %s :", "ac.exp %s, %x :")
    message = verify_error(text)
    assert message == "line 3: @f: ac.exp: expects 1 operands, got 2\n" + listing(3, text.splitlines(), 1, 5)


def test_missing_attribute():
    text = TEXT.replace("ac.constant {value = 2.0} :", "ac.constant :")
    message = verify_error(text)
    head = "line 4: @f: ac.constant: missing attribute 'value'"
    assert message == head + "\n" + listing(4, text.splitlines(), 2, 6)


def test_return_before_the_end():
    text = TEXT.replace("  %1 = ac.constant", "  ac.return %s\n  %1 = ac.constant")
    message = verify_error(text)
    head = "line 4: @f: ac.return must be the last op of its block"
    assert message == head + "\n" + listing(4, text.splitlines(), 2, 6)


def test_compound_argument_dimension():
    text = TEXT.replace("%x: tensor<T x D x f32>", "%x: tensor<(2*N) x D x f32>")
    assert verify_error(text) == (
        "@f: argument type tensor<(2*N) x D x f32>: an expression such as (2*N) may only use names "
        "that some argument's type has as a plain dimension"
    )


def test_compound_argument_dimension_of_bound_names():
    """A saved result of a backward function may have a computed size, such as (C//4)."""
    text = TEXT.replace("%y: tensor<T x D x f32>", "%y: tensor<T x D x f32>, %z: tensor<(2*T) x f32>")
    module = ac.parse_ir(text)
    x = np.ones((3, 2), np.float32)
    assert ac.interpret(module, x, x, np.ones(6, np.float32)).shape == (3, 2)
    with pytest.raises(ac.ShapeError, match=r"z: dimension 0 is 5, but \(2\*T\) = 6"):
        ac.interpret(module, x, x, np.ones(5, np.float32))


# faults the parser cannot produce: built by editing a parsed module ------------------------
def test_use_before_definition():
    module = ac.parse_ir(TEXT)
    ops = module.main.body.ops
    ops[0], ops[1] = ops[1], ops[0]
    with pytest.raises(ac.VerifyError) as info:
        verify_module(module)
    swapped = [LINES[0], LINES[2], LINES[1], *LINES[3:]]
    head = "line 2: @f: ac.exp: operand 0 is used before it is defined"
    assert str(info.value) == head + "\n" + listing(2, swapped, 1, 4)


def test_missing_return():
    module = ac.parse_ir(TEXT)
    module.main.body.ops.pop()
    with pytest.raises(ac.VerifyError) as info:
        verify_module(module)
    lines = [LINES[0].replace("-> tensor<T x D x f32>", "-> ()"), *LINES[1:5], "}"]
    head = "line 5: @f: a block must end with ac.return"
    assert str(info.value) == head + "\n" + listing(5, lines, 3, 6)


def test_empty_function():
    module = ac.parse_ir(TEXT)
    module.main.body.ops.clear()
    with pytest.raises(ac.VerifyError, match="^@f: a block must end with ac.return$"):
        verify_module(module)


def test_operand_defined_nowhere_is_shown_with_a_question_mark():
    module = ac.parse_ir(TEXT)
    del module.main.body.ops[:2]  # %s and %0 are gone, %out still uses %0
    with pytest.raises(ac.VerifyError) as info:
        verify_module(module)
    assert "ac.mul: operand 0 is used before it is defined" in str(info.value)
    assert ">    3 |   %out = ac.mul %?0, %1 : tensor<T x D x f32>" in str(info.value)


# in text, the parser reports the same faults with a line and a column ---------------------------
def test_use_before_definition_in_text_is_a_parse_error():
    text = TEXT.replace("  %s = ac.add %x, %y : tensor<T x D x f32>\n", "").replace(
        "  %1 = ac.constant", "  %s = ac.add %x, %y : tensor<T x D x f32>\n  %1 = ac.constant"
    )
    with pytest.raises(ac.IRParseError, match=r"^line 2, column 15: use of undefined value %s\n"):
        ac.parse_ir(text)


def test_missing_return_in_text_is_a_parse_error():
    text = TEXT.replace("  ac.return %out\n", "")
    with pytest.raises(ac.IRParseError, match=r"^line 1, column 62: @f must end with ac.return\n"):
        ac.parse_ir(text)


# regions --------------------------------------------------------------------------------------
FUSED = """\
ac.func @fused(%q: tensor<T x D x f32>, %k: tensor<S x D x f32>, %v: tensor<S x D x f32>) -> \
tensor<T x D x f32> {
  %out = ac.attention %q, %k, %v {kv_repeat = 1, with_lse = false} : tensor<T x D x f32> ({
  ^bb0(%i: tensor<i64>, %j: tensor<i64>, %s: tensor<f32>):
    ac.yield %s
  }, {
  ^bb0(%i_1: tensor<i64>, %j_1: tensor<i64>):
    %0 = ac.cmp %j_1, %i_1 {pred = "le"} : tensor<i1>
    ac.yield %0
  })
  ac.return %out
}
"""


def test_region_text_round_trips():
    assert str(ac.parse_ir(FUSED)) == FUSED


def test_region_must_end_with_yield():
    text = FUSED.replace("    ac.yield %0\n", "")
    message = verify_error(text)
    head = "line 7: @fused: a block must end with ac.yield"
    assert message == head + "\n" + listing(7, text.splitlines(), 5, 9)


def test_yield_must_be_last_in_its_region():
    text = FUSED.replace("    %0 = ac.cmp", "    ac.yield %j_1\n    %0 = ac.cmp")
    message = verify_error(text)
    head = "line 7: @fused: ac.yield must be the last op of its block"
    assert message == head + "\n" + listing(7, text.splitlines(), 5, 9)


def test_region_values_are_not_visible_after_the_region():
    text = FUSED.replace("  ac.return %out\n", "  %1 = ac.neg %j_1 : tensor<i64>\n  ac.return %out\n")
    with pytest.raises(ac.IRParseError, match=r"^line 10, column 15: use of undefined value %j_1"):
        ac.parse_ir(text)


def test_regions_may_use_values_from_outside():
    text = FUSED.replace("ac.cmp %j_1, %i_1", "ac.cmp %j_1, %q")
    message = verify_error(text)  # visible, but the types do not fit
    assert message.startswith("line 7: @fused: ac.cmp: result types should be tensor<T x D x i1>, not tensor<i1>")
