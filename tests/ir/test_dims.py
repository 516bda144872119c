"""Symbolic dimensions: arithmetic, canonical printing, parsing and evaluation."""

from __future__ import annotations

import pytest

from attncomp.ir.dims import Dim, dim, parse_dim

B, D, H, T, KV = (dim(n) for n in ("B", "D", "H", "T", "KV"))


# construction and queries ------------------------------------------------------
def test_dim_coerces_ints_names_and_dims():
    assert dim(64) == Dim.const(64)
    assert dim("T") == Dim.sym("T")
    assert dim(T) is T
    assert dim(" T ") == T


@pytest.mark.parametrize("bad", [True, 1.5, None, [1]])
def test_dim_rejects_other_values(bad):
    with pytest.raises(TypeError):
        dim(bad)


def test_constant_and_symbol_queries():
    assert dim(64).is_const and dim(64).value == 64
    assert dim(0).is_const and dim(0).value == 0
    assert T.is_symbol and T.symbol == "T" and not T.is_const
    assert not (2 * T).is_symbol
    assert not (T + 1).is_symbol
    assert not dim(3).is_symbol
    with pytest.raises(ValueError, match="dimension T is not a constant"):
        _ = T.value


def test_symbols_include_names_inside_floor_divisions():
    assert (D * T + H // 2).symbols() == {"D", "H", "T"}
    assert (H // KV).symbols() == {"H", "KV"}
    assert dim(5).symbols() == set()


# arithmetic ------------------------------------------------------------------------
def test_sums_and_products_are_canonical():
    assert T + D == D + T
    assert T * D == D * T
    assert (T + 1) * 2 == 2 * T + 2
    assert T + T == 2 * T
    assert T - T == dim(0)
    assert (T + D) * (T - D) == T * T - D * D
    assert 3 - T == -T + 3
    neg = -T
    assert -neg == T


def test_int_operands_on_either_side():
    assert 1 + T == T + 1
    assert 2 * T == T * 2
    assert 10 - T == -(T - 10)


@pytest.mark.parametrize(
    "value, text",
    [
        (T, "T"),
        (dim(64), "64"),
        (dim(0), "0"),
        (dim(-3), "(-3)"),
        (-T, "(-T)"),
        (T + 1, "(T+1)"),
        (2 * T + 3, "(2*T+3)"),
        (dim("B") * dim("A"), "(A*B)"),
        (dim("A") * 2 + dim("B") * 3 - 1, "(2*A+3*B-1)"),
        (T * H * 2 - 1, "(2*H*T-1)"),
        (T * T, "(T*T)"),
        (3 - T, "(-T+3)"),
        (D // 2, "(D//2)"),
        (D - D // 2, "(D-D//2)"),
        ((T + 1) // 2, "((T+1)//2)"),
        (H * (D // H), "(H*(D//H))"),
        (D // KV, "(D//KV)"),
        (-(D // 2), "(-(D//2))"),
        (1 - D // 2, "(-(D//2)+1)"),
        (T - D // 2, "(T-D//2)"),
        (-2 * (D // 2), "(-2*(D//2))"),
        (-((T + 1) // 2), "(-((T+1)//2))"),
    ],
)
def test_canonical_printing_and_parse_round_trip(value, text):
    assert str(value) == text
    assert parse_dim(text) == value
    assert str(parse_dim(text)) == text


def test_parse_dim_accepts_any_spacing_and_order():
    assert parse_dim("2 * T + 3") == 2 * T + 3
    assert parse_dim("T*2") == 2 * T
    assert parse_dim("T+T") == 2 * T
    assert parse_dim("-(D//2)") == -(D // 2)
    # as in Python, a leading minus binds tighter than //
    assert parse_dim("-D//2") == (-D) // 2
    assert parse_dim("-D//2") != -(D // 2)


@pytest.mark.parametrize(
    "text, message",
    [
        ("T$", "bad character '\\$' in dimension 'T\\$'"),
        ("T +", "dimension ends too early"),
        ("(T", "dimension ends too early"),
        ("(T+1))", "unexpected '\\)' in dimension"),
        ("T T", "unexpected 'T' in dimension"),
        ("*T", "unexpected '\\*' in dimension"),
    ],
)
def test_parse_dim_errors(text, message):
    with pytest.raises(ValueError, match=message):
        parse_dim(text)


# floor division -----------------------------------------------------------------------
def test_floordiv_simplifies_exact_quotients():
    assert D // 1 == D
    assert (4 * D) // 2 == 2 * D
    assert (2 * D + 4) // 2 == D + 2
    assert (-2 * D) // 2 == -D
    assert (D * T) // T == D
    assert (H * D + H) // H == D + 1
    assert T // T == dim(1)
    assert dim(7) // 2 == dim(3)
    assert dim(-7) // 2 == dim(-4)


def test_floordiv_keeps_inexact_quotients_as_atoms():
    assert not (D // 2).is_const
    assert (2 * D + 1) // 2 != D
    assert str((2 * D + 1) // 2) == "((2*D+1)//2)"
    assert (D // 2) * 2 != D  # D may be odd


def test_floordiv_halves_add_back_up():
    assert D // 2 + (D - D // 2) == D
    assert (D - D // 2) + D // 2 == D
    assert 2 * (D // 2) + (D - 2 * (D // 2)) == D


def test_floordiv_by_nonpositive_constant_is_an_error():
    with pytest.raises(ValueError, match="cannot divide a dimension by 0"):
        D // 0
    with pytest.raises(ValueError, match="cannot divide a dimension by -2"):
        D // -2


# evaluation -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "value, expected",
    [
        (T, 5),
        (dim(64), 64),
        (2 * T + 3, 13),
        (T * H - D, 5 * 8 - 7),
        (D // 2, 3),
        (D - D // 2, 4),
        ((T + 1) // 2, 3),
        (H // KV, 4),
        (KV * (H // KV), 8),
        (-(D // 2) + 1, -2),
        ((-D) // 2, -4),
    ],
)
def test_evaluate(value, expected):
    env = {"T": 5, "H": 8, "D": 7, "KV": 2}
    assert value.evaluate(env) == expected
    assert parse_dim(str(value)).evaluate(env) == expected


def test_evaluate_floordiv_follows_python_semantics():
    for d in range(-5, 6):
        assert (D // 3).evaluate({"D": d}) == d // 3
        assert (D - D // 3).evaluate({"D": d}) == d - d // 3


def test_evaluate_needs_every_name():
    with pytest.raises(KeyError):
        (T + D).evaluate({"T": 1})


def test_evaluate_division_by_a_zero_size_raises():
    with pytest.raises(ZeroDivisionError):
        (H // KV).evaluate({"H": 8, "KV": 0})
