"""Out-of-range gathers on the CUDA backend, under the simulator: the interpreter's ``IndexError``,
raised by the driver's checks before any kernel runs (see tests/e2e/test_gather_bounds.py)."""

from __future__ import annotations

import numpy as np
import pytest

import attncomp as ac
from attncomp.fuzz import gather_error
from tests.e2e.test_gather_bounds import document_bias, few_slopes, shifted_bias

#: blocks of 8: several query and key blocks at these sizes
PIPELINE = "cse,softmax-fusion,flash-tiling{block_q=8,block_k=8},mask-elimination,canonicalize,cse,dce"


def _normal(rng, *shape) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def _qkv(rng, t: int = 20, h: int = 2) -> list[np.ndarray]:
    return [_normal(rng, 1, h, t, 4) for _ in range(3)]


def _raised(call) -> str:
    with pytest.raises(IndexError) as info:
        call()
    return str(info.value)


@pytest.fixture(scope="module")
def shifted() -> ac.CompiledFunction:
    return ac.compile(shifted_bias, backend="cuda", pipeline=PIPELINE)


def test_the_interpreters_message_and_a_run_in_range(shifted):
    rng = np.random.default_rng(0)
    q, k, v = _qkv(rng)
    bad = [q, k, v, _normal(rng, 2, 9), np.array([4])]
    assert _raised(lambda: shifted(*bad)) == _raised(lambda: ac.interpret(shifted_bias, *bad))
    assert gather_error(_raised(lambda: shifted(*bad))) == (-15, 1, 9)
    assert gather_error(_raised(lambda: shifted.vjp(*bad))) == (-15, 1, 9)
    good = [q, k, v, _normal(rng, 2, 40), np.array([19])]
    want = ac.interpret(shifted_bias, *good)
    assert np.abs(shifted(*good) - want).max() < 1e-5 * np.abs(want).max()


@pytest.mark.parametrize("shift", [10**15, -(10**15)])
def test_a_huge_offset(shifted, shift):
    rng = np.random.default_rng(1)
    args = [*_qkv(rng), _normal(rng, 2, 9), np.array([shift])]
    assert gather_error(_raised(lambda: shifted(*args))) == (shift + 19 if shift > 0 else shift - 19, 1, 9)


def test_fewer_slopes_than_heads_and_ids_past_their_table():
    rng = np.random.default_rng(2)
    args = [*_qkv(rng, h=4), np.array([0.5, 0.25], dtype=np.float32)]
    fn = ac.compile(few_slopes, backend="cuda", pipeline=PIPELINE)
    assert gather_error(_raised(lambda: fn(*args))) == (3, 0, 2)
    doc = np.repeat(np.arange(5, dtype=np.int32), 4)[None]  # ids 0..4 for a table of 3
    args = [*_qkv(rng), doc, _normal(rng, 3)]
    fn = ac.compile(document_bias, backend="cuda", pipeline=PIPELINE)
    assert (
        gather_error(_raised(lambda: fn(*args)))
        == gather_error(_raised(lambda: ac.interpret(document_bias, *args)))
        == (4, 0, 3)
    )


def test_a_decoder_step_leaves_the_device_cache_as_it_was():
    rng = np.random.default_rng(3)
    q, k, v = _qkv(rng, t=12)
    table, shift = _normal(rng, 2, 19), np.array([9])
    dec = ac.compile(shifted_bias, backend="cuda", pipeline=PIPELINE).decoder(max_len=16)
    dec(q[:, :, :10], k[:, :, :10], v[:, :, :10], table, shift)
    before = {name: c.copy_to_host() for name, c in dec.cache.items()}
    message = _raised(lambda: dec(q[:, :, 10:11], k[:, :, 10:11], v[:, :, 10:11], table, shift))
    assert gather_error(message) == (-1, 1, 19)
    assert dec.length == 10
    for name, c in dec.cache.items():
        np.testing.assert_array_equal(c.copy_to_host(), before[name])
