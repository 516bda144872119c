"""The IR text: exact printed form, parse/print round trips, and parse errors with positions."""

# Dimension names in annotations (ac.f32["T", "D"]) are not forward references.
# ruff: noqa: F821, UP037

import pytest
from conftest import example_names, load_example

import attncomp as ac


@ac.spec
def small(q: ac.f32["T", "D"], k: ac.f32["S", "D"], *, scale: float = 0.125, causal: bool = True):
    s = q @ k.mT * scale
    i, j = ac.index(s)
    s = ac.where(j <= i, s, -ac.inf)
    return ac.softmax(s, axis=-1), ac.logsumexp(s)


SMALL_IR = """\
ac.func @small(%q: tensor<T x D x f32>, %k: tensor<S x D x f32>) -> (tensor<T x S x f32>, tensor<T x f32>) \
attributes {causal = true, scale = 0.125} {
  %0 = ac.transpose %k {perm = [1, 0]} : tensor<D x S x f32>
  %1 = ac.matmul %q, %0 : tensor<T x S x f32>
  %2 = ac.constant {value = 0.125} : tensor<f32>
  %s = ac.mul %1, %2 : tensor<T x S x f32>
  %i = ac.iota {axis = 0} : tensor<T x 1 x i64>
  %j = ac.iota {axis = 1} : tensor<1 x S x i64>
  %3 = ac.cmp %j, %i {pred = "le"} : tensor<T x S x i1>
  %4 = ac.constant {value = -inf} : tensor<f32>
  %s_1 = ac.where %3, %s, %4 : tensor<T x S x f32>
  %5 = ac.softmax %s_1 {axis = 1} : tensor<T x S x f32>
  %6 = ac.logsumexp %s_1 {axis = 1, keepdims = false} : tensor<T x f32>
  ac.return %5, %6
}
"""


def test_golden_text_of_a_small_spec():
    assert str(small.ir) == SMALL_IR


@ac.spec
def halves(x: ac.f32["B", "T", "D"]):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return ac.concat([-x2, x1], axis=-1).reshape(x.shape[0], -1)


HALVES_IR = """\
ac.func @halves(%x: tensor<B x T x D x f32>) -> tensor<B x (D*T) x f32> {
  %x1 = ac.slice %x {axis = 2, start = 0, step = 1, stop = (D//2)} : tensor<B x T x (D//2) x f32>
  %x2 = ac.slice %x {axis = 2, start = (D//2), step = 1, stop = D} : tensor<B x T x (D-D//2) x f32>
  %0 = ac.neg %x2 : tensor<B x T x (D-D//2) x f32>
  %1 = ac.concat %0, %x1 {axis = 2} : tensor<B x T x D x f32>
  %out = ac.reshape %1 : tensor<B x (D*T) x f32>
  ac.return %out
}
"""


def test_golden_text_with_symbolic_sizes_and_value_names():
    assert str(halves.ir) == HALVES_IR


@ac.spec
def constants(
    x: ac.i64["N"],
    *,
    eps: float = 1e-05,
    big: float = 1e16,
    offset: int = -3,
    label: str = 'say "hi"\\ to\n\u00e9',
    huge: int = 2**70,
):
    y = x + offset
    return ac.where(y > big, -ac.inf, y * eps), ac.where(y < 0, float("nan"), 0.5)


@ac.spec
def shadowed(x: ac.f64["T"], s_1: ac.f64["T"]):
    s = x * 2
    s = s + s_1
    s = s * s
    out = s - 1
    return out * out


ROUND_TRIP_SPECS = [small, halves, constants, shadowed]


@pytest.mark.parametrize("spec", ROUND_TRIP_SPECS, ids=lambda s: s.name)
def test_print_parse_print_is_the_identity(spec):
    text = str(spec.ir)
    assert str(ac.parse_ir(text)) == text


def test_attribute_values_survive_the_round_trip():
    text = str(constants.ir)
    header = text.splitlines()[0]
    assert header.endswith(
        "attributes {big = 1e+16, eps = 1e-05, huge = 1180591620717411303424, "
        'label = "say \\"hi\\"\\\\ to\\n\\u00e9", offset = -3} {'
    )
    assert "ac.constant {value = nan} : tensor<f32>" in text
    assert "ac.constant {value = -3} : tensor<i64>" in text
    assert ac.parse_ir(text).main.attrs == constants.ir.main.attrs


def test_names_are_unique_and_keep_the_spec_variables():
    text = str(shadowed.ir)
    assert "%s = ac.mul %x, %0" in text
    assert "%s_2 = ac.add %s, %s_1" in text  # the argument s_1 keeps its name
    assert "%s_3 = ac.mul %s_2, %s_2" in text
    assert "%out = ac.sub %s_3, %1" in text
    assert "%out_1 = ac.mul %out, %out" in text


def test_parsing_non_canonical_spacing_prints_canonical_text():
    messy = SMALL_IR.replace(" : ", "  :\t").replace(", ", " ,  ").replace("\n  ", "\n      ")
    assert messy != SMALL_IR
    assert str(ac.parse_ir(messy)) == SMALL_IR


def test_several_functions_in_one_module():
    text = SMALL_IR + "\n" + HALVES_IR
    module = ac.parse_ir(text)
    assert [f.name for f in module.funcs] == ["small", "halves"]
    assert str(module) == text


# the examples ------------------------------------------------------------------------------
def example_specs(name: str) -> list[ac.Spec]:
    module = load_example(name)
    return [v for v in vars(module).values() if isinstance(v, ac.Spec)]


@pytest.mark.parametrize("name", example_names())
def test_every_example_spec_round_trips(name):
    specs = example_specs(name)
    assert specs, f"examples/{name}.py defines no spec"
    for spec in specs:
        text = str(spec.ir)
        assert str(ac.parse_ir(text)) == text, spec.name


@pytest.mark.parametrize("name", example_names())
def test_every_stage_of_every_example_round_trips(name):
    for spec in example_specs(name):
        fn = ac.compile(spec, backend="interp")
        for stage in ["input", *fn.stages]:
            text = fn.ir(stage)
            assert str(ac.parse_ir(text)) == text, f"{spec.name} after {stage}"


# parse errors ---------------------------------------------------------------------------------
def position(text: str, needle: str) -> tuple[int, int]:
    """1-based line and column of the first ``needle`` in ``text``."""
    offset = text.index(needle)
    line = text.count("\n", 0, offset) + 1
    column = offset - (text.rfind("\n", 0, offset) + 1) + 1
    return line, column


def parse_error(text: str) -> ac.IRParseError:
    with pytest.raises(ac.IRParseError) as info:
        ac.parse_ir(text)
    return info.value


def assert_parse_error(text: str, at: str, message: str) -> None:
    """Parsing ``text`` fails at the first ``at`` with ``message`` and shows that line."""
    line, column = position(text, at)
    err = parse_error(text)
    assert (err.line, err.column) == (line, column)
    source = text.splitlines()[line - 1]
    caret = " " * (column - 1) + "^"
    assert str(err) == f"line {line}, column {column}: {message}\n  {source}\n  {caret}"


def test_unknown_character():
    text = SMALL_IR.replace("ac.where %3,", "ac.where #3,")
    assert_parse_error(text, "#3", "unexpected character '#'")


def test_undefined_value():
    text = SMALL_IR.replace("ac.where %3, %s,", "ac.where %3, %t,")
    assert_parse_error(text, "%t", "use of undefined value %t")


def test_use_before_definition_is_an_undefined_value():
    text = SMALL_IR.replace("%1 = ac.matmul %q, %0", "%1 = ac.matmul %q, %2")
    assert_parse_error(text, "%2 :", "use of undefined value %2")


def test_duplicate_definition():
    text = SMALL_IR.replace("%4 = ac.constant", "%s = ac.constant")
    assert_parse_error(text, "%s = ac.constant", "%s is defined twice")


def test_duplicate_argument():
    text = SMALL_IR.replace("%k: tensor<S x D x f32>", "%q: tensor<S x D x f32>")
    assert_parse_error(text, "%q: tensor<S", "%q is defined twice")


def test_bad_element_type():
    text = SMALL_IR.replace("%k: tensor<S x D x f32>", "%k: tensor<S x D x f33>")
    assert_parse_error(text, "f33", "expected an element type (f16, bf16, f32, f64, i32, i64, i1, f8e4m3, f8e5m2)")


def test_type_without_element_type():
    text = SMALL_IR.replace("%k: tensor<S x D x f32>", "%k: tensor<S x D>")
    assert_parse_error(text, "D>", "expected an element type (f16, bf16, f32, f64, i32, i64, i1, f8e4m3, f8e5m2)")


def test_misspelled_tensor_type():
    text = SMALL_IR.replace("%k: tensor<S x D x f32>", "%k: tensr<S x D x f32>")
    assert_parse_error(text, "tensr", "expected 'tensor', found 'tensr'")


def test_bad_dimension():
    text = SMALL_IR.replace(": tensor<D x S x f32>", ": tensor<D x (S+) x f32>")
    assert_parse_error(text, "(S+)", "unexpected ')' in dimension")


def test_duplicate_attribute():
    text = SMALL_IR.replace("{axis = 1} :", "{axis = 1, axis = 2} :")
    assert_parse_error(text, "axis = 2", "attribute 'axis' is given twice")


def test_missing_closing_brace():
    text = SMALL_IR[: SMALL_IR.rindex("}")]
    err = parse_error(text)
    assert (err.line, err.column) == (14, 1)  # just past the last line
    assert str(err) == "line 14, column 1: expected '}' to close @small, found the end of the text"


def test_op_result_count_mismatch():
    text = SMALL_IR.replace("%5 = ac.softmax", "%5, %7 = ac.softmax")
    assert_parse_error(text, "ac.softmax", "ac.softmax names 2 results but gives 1 types")


def test_function_result_count_mismatch():
    text = SMALL_IR.replace("ac.return %5, %6", "ac.return %5")
    assert_parse_error(text, "->", "@small declares results that ac.return does not give (tensor<T x S x f32>)")


def test_function_result_type_mismatch():
    text = SMALL_IR.replace("ac.return %5, %6", "ac.return %6, %5")
    message = "@small declares results that ac.return does not give (tensor<T x f32>, tensor<T x S x f32>)"
    assert_parse_error(text, "->", message)


def test_missing_return():
    text = SMALL_IR.replace("  ac.return %5, %6\n", "")
    assert_parse_error(text, "->", "@small must end with ac.return")


def test_empty_text():
    err = parse_error("")
    assert (err.line, err.column) == (1, 1)
    assert str(err) == "line 1, column 1: expected 'ac.func'"
