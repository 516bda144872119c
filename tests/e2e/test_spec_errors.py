"""Specs that cannot be traced raise ac.SpecError naming this file and the offending line.

Each offending line carries a ``# <- NAME`` marker; ``line_of("NAME")`` finds it.
"""

# Dimension names in annotations (ac.f32["T", "D"]) are not forward references.
# ruff: noqa: F821, UP037

import math
from pathlib import Path

import numpy as np
import pytest

import attncomp as ac

SOURCE = Path(__file__).read_text().splitlines()


def line_of(marker: str) -> int:
    """The 1-based line of this file that ends with ``# <- marker``."""
    hits = [k + 1 for k, line in enumerate(SOURCE) if line.rstrip().endswith(f"# <- {marker}")]
    assert len(hits) == 1, f"marker {marker!r} found {len(hits)} times"
    return hits[0]


def assert_located(info: pytest.ExceptionInfo, marker: str, message: str) -> None:
    """The error reads ``FILE:LINE: message`` and then shows the source line."""
    line = line_of(marker)
    text = str(info.value)
    first, _, rest = text.partition("\n")
    assert first == f"{__file__}:{line}: {message}"
    assert rest == "    " + SOURCE[line - 1].strip()


DATA_DEPENDENT = (
    "needs a concrete value, but tensors only have values when the compiled function runs "
    "(a Python if/while/and/or/not, int() or float() on a tensor depends on data); "
    "use ac.where for data-dependent choices"
)


def test_python_if_on_a_tensor():
    with pytest.raises(ac.SpecError) as info:

        @ac.spec
        def f(x: ac.f32["T"]):
            if x > 0:  # <- if
                return x
            return -x

    assert_located(info, "if", "truth value of a tensor " + DATA_DEPENDENT)


def test_python_and_of_tensors():
    with pytest.raises(ac.SpecError) as info:

        @ac.spec
        def f(x: ac.f32["T"]):
            return (x > 0) and (x < 1)  # <- and

    assert_located(info, "and", "truth value of a tensor " + DATA_DEPENDENT)


def test_while_on_a_size():
    with pytest.raises(ac.SpecError) as info:

        @ac.spec
        def f(x: ac.f32["T"]):
            while x.shape[0] > 3:  # <- while
                x = x * 2
            return x

    assert_located(info, "while", "comparing size T (<) " + DATA_DEPENDENT)


def test_int_of_a_symbolic_size():
    with pytest.raises(ac.SpecError) as info:

        @ac.spec
        def f(x: ac.f32["T"]):
            return x * int(x.shape[0])  # <- int

    assert_located(info, "int", "size T is symbolic: it is only known when the compiled function runs")


def test_numpy_function_on_a_tensor():
    with pytest.raises(ac.SpecError) as info:

        @ac.spec
        def f(x: ac.f32["T"]):
            y = x + 1
            return np.exp(y)  # <- np.exp

    assert_located(info, "np.exp", "numpy's exp cannot trace a tensor; use the ac. function")


def test_numpy_array_function_on_a_tensor():
    with pytest.raises(ac.SpecError) as info:

        @ac.spec
        def f(x: ac.f32["T"]):
            return np.sum(x)  # <- np.sum

    assert_located(info, "np.sum", "numpy's sum cannot trace a tensor; use the ac. function")


def test_math_function_on_a_tensor():
    with pytest.raises(ac.SpecError) as info:

        @ac.spec
        def f(x: ac.f32["T"]):
            return math.exp(x)  # <- math.exp

    assert_located(info, "math.exp", "float() of a tensor " + DATA_DEPENDENT)


def test_unknown_ac_function():
    with pytest.raises(ac.SpecError) as info:

        @ac.spec
        def f(x: ac.f32["T"]):
            return ac.foo(x)  # <- ac.foo

    first = str(info.value).splitlines()[0]
    assert first.startswith(f"{__file__}:{line_of('ac.foo')}: AttributeError: attncomp has no name 'foo'; ")
    assert "exp" in first and "softmax" in first


def test_unknown_tensor_method():
    with pytest.raises(ac.SpecError) as info:

        @ac.spec
        def f(x: ac.f32["T"]):
            y = x * 2
            return y.frobnicate()  # <- method

    assert_located(info, "method", "AttributeError: 'Tensor' object has no attribute 'frobnicate'")


def test_shapes_that_cannot_broadcast():
    with pytest.raises(ac.SpecError) as info:

        @ac.spec
        def f(q: ac.f32["B", "T"], k: ac.f32["B", "S"]):
            return q + k  # <- broadcast

    assert_located(info, "broadcast", "ac.add: shapes (B, T) and (B, S) cannot broadcast: T against S on axis -1")


def test_dimension_name_bound_to_two_sizes():
    with pytest.raises(ac.SpecError) as info:

        @ac.spec
        def f(q: ac.f32["T", "D"], w: ac.f32[64, 32]):
            return q @ w  # <- D vs 64

    message = "ac.matmul: contracted dimension (D against 64): dimension D does not match 64"
    assert_located(info, "D vs 64", message)


def test_two_names_never_unify():
    with pytest.raises(ac.SpecError) as info:

        @ac.spec
        def f(q: ac.f32["T", "D"], k: ac.f32["S", "E"]):
            return q @ k.mT  # <- D vs E

    assert_located(info, "D vs E", "ac.matmul: contracted dimension (D against E): dimension D does not match E")


def test_bool_arithmetic():
    with pytest.raises(ac.SpecError) as info:

        @ac.spec
        def f(x: ac.f32["T"]):
            return (x > 0) + 1  # <- bool

    assert_located(info, "bool", "ac.add: operands must be numbers, got a bool tensor")


def test_gather_with_a_float_index():
    with pytest.raises(ac.SpecError) as info:

        @ac.spec
        def f(x: ac.f32["T"], i: ac.f32["N"]):
            return x[i]  # <- gather

    assert_located(info, "gather", "ac.gather: index 0 must be an integer tensor, got f32")


def test_bad_reshape():
    with pytest.raises(ac.SpecError) as info:

        @ac.spec
        def f(x: ac.f32[4, 3]):
            return x.reshape(5, 2)  # <- reshape

    assert_located(info, "reshape", "ac.reshape: cannot reshape 12 elements into 10")


def test_negative_slice_step():
    with pytest.raises(ac.SpecError) as info:

        @ac.spec
        def f(x: ac.f32["T"]):
            return x[::-1]  # <- step

    assert_located(info, "step", "slice step must be a positive int, got -1")


def test_bad_axis():
    with pytest.raises(ac.SpecError) as info:

        @ac.spec
        def f(x: ac.f32["T", "D"]):
            return ac.sum(x, axis=2)  # <- axis

    assert_located(info, "axis", "axis 2 is out of range for a tensor of rank 2")


def test_bad_softmax_axis():
    with pytest.raises(ac.SpecError) as info:

        @ac.spec
        def f(x: ac.f32["T", "D"]):
            return ac.softmax(x, axis=-3)  # <- softmax axis

    assert_located(info, "softmax axis", "axis -3 is out of range for a tensor of rank 2")


def test_axis_must_be_an_int():
    with pytest.raises(ac.SpecError) as info:

        @ac.spec
        def f(x: ac.f32["T", "D"]):
            return ac.max(x, axis=1.0)  # <- float axis

    assert_located(info, "float axis", "an axis must be an int, got 1.0")


# the signature and the result ------------------------------------------------------------------
def test_positional_argument_without_a_tensor_annotation():
    with pytest.raises(ac.SpecError) as info:

        @ac.spec
        def f(
            q: ac.f32["T", "D"],
            scale: float,  # <- unannotated
        ):
            return q * scale

    message = (
        'argument \'scale\' needs a tensor annotation such as ac.f32["B", "T", "D"] '
        "(keyword-only arguments are compile-time constants)"
    )
    assert_located(info, "unannotated", message)


def test_positional_argument_without_any_annotation():
    with pytest.raises(ac.SpecError) as info:

        @ac.spec
        def f(q):  # <- no annotation
            return q

    assert str(info.value).startswith(f"{__file__}:{line_of('no annotation')}: argument 'q' needs a tensor")


def test_keyword_only_constant_without_default():
    with pytest.raises(ac.SpecError) as info:

        @ac.spec
        def f(q: ac.f32["T"], *, window):  # <- no default
            return q

    assert_located(info, "no default", "compile-time constant 'window' needs a default value")


def test_star_args():
    with pytest.raises(ac.SpecError) as info:

        @ac.spec
        def f(*xs):  # <- star
            return xs[0]

    assert_located(info, "star", "*args and **kwargs are not supported in a spec")


def test_returning_a_python_float():
    with pytest.raises(ac.SpecError) as info:

        @ac.spec
        def f(x: ac.f32["T"]):
            x = x * 2
            return 1.0  # <- float

    assert_located(info, "float", "spec f must return tensors; result 0 is float")


def test_returning_a_float_in_a_tuple():
    with pytest.raises(ac.SpecError) as info:

        @ac.spec
        def f(x: ac.f32["T"]):
            return x, 0.5  # <- tuple

    assert_located(info, "tuple", "spec f must return tensors; result 1 is float")


def test_returning_nothing_points_at_the_def():
    with pytest.raises(ac.SpecError) as info:

        @ac.spec
        def f(x: ac.f32["T"]):  # <- none
            x = x * 2

    assert_located(info, "none", "spec f must return tensors; result 0 is NoneType")


# outside a spec -----------------------------------------------------------------------------------
def test_bad_dimension_in_an_annotation():
    with pytest.raises(ac.SpecError, match=r"^f32\[\.\.\.\]: 'x' cannot name a dimension$"):
        ac.f32["T", "x"]
    with pytest.raises(ac.SpecError, match=r"^f32\[\.\.\.\]: a dimension is a name or a size, got 1.5$"):
        ac.f32[1.5]
    with pytest.raises(ac.SpecError, match=r"^i64\[\.\.\.\]: a size must not be negative, got -1$"):
        ac.i64[-1]


def test_ac_function_outside_a_spec():
    with pytest.raises(
        ac.SpecError, match=r"^ac.exp needs a traced tensor argument \(it is only used inside a spec\)$"
    ):
        ac.exp(np.ones(3))


def test_calling_a_spec_directly_is_a_type_error():
    @ac.spec
    def f(x: ac.f32["T"]):
        return x

    with pytest.raises(
        TypeError, match=r"^spec f is not called directly: use ac.compile\(f\) or ac.interpret\(f, ...\)$"
    ):
        f(np.ones(3, np.float32))


def test_a_page_view_on_an_axis_that_holds_no_rows():
    with pytest.raises(ac.SpecError) as info:

        @ac.spec
        def pages_on_heads(pages: ac.f32["N", "P", "H", "D"], table: ac.i32["B", "E"]):
            return ac.page_view(pages, table, 8, slot=0)  # <- page_slot

    assert_located(info, "page_slot", "ac.page_view: slot is 1 or -2 (the pages' axis holding a page's rows), got 0")
