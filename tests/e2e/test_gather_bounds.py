"""Gathers in compiled kernels never read outside their source.

flash-tiling puts an ``ac.check_index`` before each tiled attention for every axis of every
gather in its regions (passes/gather_bounds.py): the index's bounds over the whole grid, computed
at call time.  An index out of range raises the interpreter's ``IndexError`` (the spec's file and
line, the gather, the index, the axis and its size) before any kernel runs, on every backend; an
index in range is read by kernels with no check at all.

Three specs are compiled on the cpu backend once for the file (a Numba compile each).
"""

# Dimension names in annotations (ac.f32["T", "D"]) are not forward references.
# ruff: noqa: F821, UP037

from __future__ import annotations

import mmap
import re

import numpy as np
import pytest

import attncomp as ac
from attncomp.fuzz import gather_error
from tests.conftest import example_names, load_example


@ac.spec
def shifted_bias(
    q: ac.f32["B", "H", "T", "D"],
    k: ac.f32["B", "H", "S", "D"],
    v: ac.f32["B", "H", "S", "D"],
    table: ac.f32["H", "R"],
    shift: ac.i64[1],
):
    """A relative-position table read at ``j - i + shift``: nothing keeps it inside the table."""
    s = (q @ k.mT) * q.shape[-1] ** -0.5
    b, h, i, j = ac.index(s)
    s = s + table[h, j - i + shift[0]]
    return ac.softmax(ac.where(j <= i, s, -ac.inf), axis=-1) @ v


@ac.spec
def few_slopes(
    q: ac.f32["B", "H", "T", "D"],
    k: ac.f32["B", "H", "S", "D"],
    v: ac.f32["B", "H", "S", "D"],
    slopes: ac.f32["N"],
):
    """ALiBi whose slopes are sized on their own: fewer slopes than heads reads past them."""
    s = (q @ k.mT) * q.shape[-1] ** -0.5
    b, h, i, j = ac.index(s)
    return ac.softmax(ac.where(j <= i, s + slopes[h] * (j - i), -ac.inf), axis=-1) @ v


@ac.spec
def document_bias(
    q: ac.f32["B", "H", "T", "D"],
    k: ac.f32["B", "H", "T", "D"],
    v: ac.f32["B", "H", "T", "D"],
    doc: ac.i32["B", "T"],
    per_doc: ac.f32["M"],
):
    """A bias per document, read through the document ids the user passes."""
    s = (q @ k.mT) * q.shape[-1] ** -0.5
    b, h, i, j = ac.index(s)
    return ac.softmax(s + per_doc[doc[b, j]], axis=-1) @ v


def _normal(rng, *shape) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def _qkv(rng, t: int = 70, h: int = 2) -> list[np.ndarray]:
    return [_normal(rng, 1, h, t, 8) for _ in range(3)]


@pytest.fixture(scope="module")
def shifted_cpu() -> ac.CompiledFunction:
    return ac.compile(shifted_bias, backend="cpu")


def _raised(call) -> str:
    with pytest.raises(IndexError) as info:
        call()
    return str(info.value)


def _every_backend(spec, args, cpu: ac.CompiledFunction | None = None) -> list[str]:
    """The messages of the raw interpreter, the interp backend, the unfused and the tiled cpu backend."""
    calls = [
        lambda: ac.interpret(spec, *args),
        lambda: ac.compile(spec, backend="interp")(*args),
        lambda: ac.compile(spec, backend="cpu", pipeline="")(*args),
    ]
    if cpu is not None:
        calls.append(lambda: cpu(*args))
    return [_raised(call) for call in calls]


# the error ------------------------------------------------------------------------------------
def test_a_short_table_is_the_interpreters_error_on_every_backend(shifted_cpu):
    rng = np.random.default_rng(0)
    args = [*_qkv(rng), _normal(rng, 2, 9), np.array([4])]
    messages = _every_backend(shifted_bias, args, shifted_cpu)
    assert len(set(messages)) == 1, messages
    first, source = messages[0].split("\n")
    # j - i + 4 over 70 rows and keys reaches 0 - 69 + 4
    assert re.fullmatch(
        r"\S+test_gather_bounds\.py:\d+: ac\.gather: index -65 is out of range for axis 1 of size 9", first
    )
    assert source.strip() == "s = s + table[h, j - i + shift[0]]"


def test_in_range_the_same_spec_runs_and_matches_the_interpreter(shifted_cpu):
    rng = np.random.default_rng(1)
    args = [*_qkv(rng), _normal(rng, 2, 140), np.array([69])]  # j - i + 69 in [0, 138]
    got = shifted_cpu(*args)
    want = ac.interpret(shifted_bias, *args)
    assert np.abs(got - want).max() < 1e-5 * np.abs(want).max()


@pytest.mark.parametrize("shift", [10**15, -(10**15), 2**31 + 5])
def test_a_huge_offset_raises_and_does_not_crash(shifted_cpu, shift):
    rng = np.random.default_rng(2)
    args = [*_qkv(rng), _normal(rng, 2, 9), np.array([shift])]
    bad = shift + 69 if shift > 0 else shift - 69
    assert gather_error(_raised(lambda: shifted_cpu(*args))) == (bad, 1, 9)


def test_gradients_check_the_same_gathers(shifted_cpu):
    """fn.vjp runs the saving forward, which checks first; the backward's own checks guard its sites."""
    rng = np.random.default_rng(3)
    args = [*_qkv(rng), _normal(rng, 2, 9), np.array([4])]
    message = _raised(lambda: shifted_cpu.vjp(*args))
    assert gather_error(message) == (-65, 1, 9)
    backward_ir = shifted_cpu.backward.ir()
    assert "ac.check_index" in backward_ir and "size = R" in backward_ir
    good = [*args[:3], _normal(rng, 2, 140), np.array([69])]
    out, lse = shifted_cpu.forward_saving(*good)[-2:]
    bad_backward = [*args, out, lse, _normal(rng, 1, 2, 70, 8)]
    assert gather_error(_raised(lambda: shifted_cpu.backward(*bad_backward))) == (-65, 1, 9)


def test_fewer_slopes_than_heads():
    rng = np.random.default_rng(4)
    args = [*_qkv(rng, t=20, h=4), np.array([0.5, 0.25], dtype=np.float32)]
    messages = _every_backend(few_slopes, args)
    assert {gather_error(m) for m in messages} == {(3, 0, 2)}
    assert len(set(messages)) == 1


def test_an_index_read_from_the_users_document_ids():
    """Ids past the per-document table: bounded by the ids' minimum and maximum."""
    rng = np.random.default_rng(5)
    doc = np.array([[0, 0, 1, 1, 2, 2, 3, 3, 3, 3]], dtype=np.int32)
    args = [*_qkv(rng, t=10), doc, _normal(rng, 3)]
    raw, tiled, unfused = _every_backend(document_bias, args)
    assert gather_error(raw) == gather_error(tiled) == gather_error(unfused) == (3, 0, 3)
    assert "an index may reach 3" in tiled  # the tiled pipeline checks the ids' maximum, before the kernels
    assert unfused == raw  # the unfused graph checks each id as the interpreter does
    args[3] = doc.clip(0, 2)  # in range: runs
    want = ac.interpret(document_bias, *args)
    assert np.abs(ac.compile(document_bias, backend="interp")(*args) - want).max() < 1e-5 * np.abs(want).max()
    negative = doc.copy()
    negative[0, 4] = -7
    args[3] = negative
    assert gather_error(_raised(lambda: ac.compile(document_bias, backend="interp")(*args))) == (-7, 0, 3)


def test_an_index_interval_arithmetic_cannot_bound_is_a_compile_error():
    @ac.spec
    def squared(q: ac.f32["T", "D"], k: ac.f32["S", "D"], v: ac.f32["S", "D"], table: ac.f32["R"]):
        s = q @ k.mT
        i, j = ac.index(s)
        return ac.softmax(s + table[(i - j) % ((i % 3) + 1)], axis=-1) @ v

    with pytest.raises(ac.PipelineError, match=r"test_gather_bounds\.py:\d+: flash-tiling: cannot bound index 0"):
        ac.compile(squared, backend="interp")
    assert "ac.gather" in ac.compile(squared, backend="interp", pipeline="").ir()  # unfused: checked as it runs


# decoding -------------------------------------------------------------------------------------
def test_a_decoder_step_that_would_read_past_the_table_leaves_the_cache_as_it_was():
    rng = np.random.default_rng(6)
    q, k, v = _qkv(rng, t=12)
    table = _normal(rng, 2, 19)
    shift = np.array([9])  # over ten positions (masked ones too) j - i + 9 stays in [0, 18]
    dec = ac.compile(shifted_bias, backend="interp").decoder(max_len=16)
    out = dec(q[:, :, :10], k[:, :, :10], v[:, :, :10], table, shift)
    want = ac.interpret(shifted_bias, q[:, :, :10], k[:, :, :10], v[:, :, :10], table, shift)
    assert np.abs(out - want).max() < 1e-5 * np.abs(want).max()
    before = {name: np.array(c) for name, c in dec.cache.items()}
    message = _raised(lambda: dec(q[:, :, 10:11], k[:, :, 10:11], v[:, :, 10:11], table, shift))
    assert gather_error(message) == (-1, 1, 19)  # key 0 from query 10: 0 - 10 + 9
    assert dec.length == 10
    for name, c in dec.cache.items():
        np.testing.assert_array_equal(c, before[name])


# no check where the index is in range ---------------------------------------------------------
@pytest.mark.parametrize("name", example_names())
def test_the_kernels_of_every_example_read_without_checks(name):
    """Checks run in the driver, before the kernels; no tile loop tests an index."""
    module = load_example(name)
    for spec in [v for v in vars(module).values() if isinstance(v, ac.Spec)]:
        fn = ac.compile(spec, backend="cpu")
        kernels = fn.source.split("def run(")[0]
        for needle in ("IndexError", "out of range", "check_index"):
            assert needle not in kernels, f"{spec.name}: {needle!r} in the kernel source"


def test_indices_in_range_for_every_size_are_not_checked_at_all():
    """slopes[h] with H slopes: proven when compiled.  The clamped relative bias: its head axis is
    proven, its column needs R >= 2 * max_distance + 1, checked once per call (exact bounds)."""
    alibi = ac.compile(load_example("alibi").causal_alibi, backend="cpu")
    assert "ac.check_index" not in alibi.ir() and "check_index" not in alibi.source
    relative = ac.compile(load_example("relative_bias").relative_bias, backend="interp")
    (check,) = [line for line in relative.ir().splitlines() if "ac.check_index" in line]
    assert "axis = 1" in check and "size = R" in check and "exact = true" in check


# 64-bit offsets -------------------------------------------------------------------------------
@ac.spec
def windowed_bias(
    q: ac.f32["B", "H", "T", "D"],
    k: ac.f32["B", "H", "S", "D"],
    v: ac.f32["B", "H", "S", "D"],
    bias: ac.f32["B", "H", "T", "S"],
):
    s = (q @ k.mT) * q.shape[-1] ** -0.5 + bias
    b, h, i, j = ac.index(s)
    return ac.softmax(ac.where((j <= i) & (i - j < 2), s, -ac.inf), axis=-1) @ v


def test_offsets_past_two_to_the_31_in_a_bias_over_8_gib(tmp_path):
    """A [1, 1, T, T] float32 bias of T = 46341 holds 2^31 + 2^16 elements: the kernel reads its
    last rows (offsets past 2^31) from a sparse memory-mapped file, with no 8 GiB in memory."""
    t = 46341
    bias = np.lib.format.open_memmap(tmp_path / "bias.npy", mode="w+", dtype=np.float32, shape=(1, 1, t, t))
    assert bias.size > 2**31
    if hasattr(mmap, "MADV_RANDOM"):  # no read-ahead: only the pages the kernel reads are mapped
        bias._mmap.madvise(mmap.MADV_RANDOM)
    rng = np.random.default_rng(7)
    q, k, v = (_normal(rng, 1, 1, t, 4) for _ in range(3))
    last = [t - 2, t - 1]
    bias[0, 0, t - 1, last] = [3.0, -2.0]  # the last row's two visible keys, at flat offsets ~2^31 + 2^16
    bias[0, 0, t - 2, [t - 3, t - 2]] = [-1.0, 4.0]
    bias.flush()
    out = ac.compile(windowed_bias, backend="cpu")(q, k, v, bias)
    for row in (t - 2, t - 1):
        keys = [row - 1, row]
        s = q[0, 0, row] @ k[0, 0, keys].T * 0.5 + np.asarray(bias[0, 0, row, keys], dtype=np.float64)
        p = np.exp(s - s.max())
        want = (p / p.sum()) @ v[0, 0, keys]
        np.testing.assert_allclose(out[0, 0, row], want, rtol=1e-5, atol=1e-6)
