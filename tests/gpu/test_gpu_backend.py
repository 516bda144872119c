"""The CUDA backend on a GPU, at its default blocks: every example and pass-test spec, forward
and gradients, against the interpreter in float64.

Sizes span several default blocks and are not multiples of them (T = 300, S = 270), so the
tiled forward and backward meet skipped, masked, full and partial tiles as at real sizes.
"""

from __future__ import annotations

import numpy as np
import pytest

import attncomp as ac
from attncomp.testing import TOLERANCE, random_inputs, relative_error, worst_error
from tests.passes.test_translation_validation import _cases

cuda = pytest.importorskip("numba.cuda", reason="the cuda extra (numba-cuda) is not installed")
if not cuda.is_available():
    pytest.skip("no CUDA GPU is available", allow_module_level=True)

SIZES = {
    "B": 2,
    "H": 4,
    "KV": 2,
    "T": 300,
    "S": 270,
    "D": 64,
    "E": 48,
    "C": 96,
    "C3": 288,
    "HD": 96,
    "KVD": 96,
    "R": 40,
}


def _as_list(result) -> list:
    return list(result) if isinstance(result, tuple) else [result]


def _inputs(spec) -> list[np.ndarray]:
    return random_inputs(spec.ir.main, SIZES, seed=11)


@pytest.mark.parametrize("module,spec", _cases())
def test_forward_at_default_blocks(module, spec):
    inputs = _inputs(spec)
    got = _as_list(ac.compile(spec, backend="cuda")(*inputs))
    want = _as_list(ac.compile(spec, backend="interp")(*inputs))
    assert [g.shape for g in got] == [w.shape for w in want]
    assert worst_error(got, want) < 5 * TOLERANCE["f32"]


@pytest.mark.parametrize("module,spec", _cases())
def test_gradients_at_default_blocks(module, spec):
    inputs = _inputs(spec)
    fn = ac.compile(spec, backend="cuda")
    out, pullback = fn.vjp(*inputs)
    rng = np.random.default_rng(12)
    cotangents = [rng.standard_normal(np.shape(o)).astype(np.asarray(o).dtype) for o in _as_list(out)]
    got = pullback(*cotangents)
    want = ac.compile(spec, backend="interp").vjp(*inputs)[1](*cotangents)
    for k, (g, w, a) in enumerate(zip(got, want, inputs)):
        if w is None:
            assert g is None, f"argument {k}"
            continue
        assert g.shape == a.shape and g.dtype == a.dtype, f"argument {k}"
        tolerance = 1e-10 if a.dtype == np.float64 else 1e-4
        if np.abs(w).max() < 1e-12:  # a gradient that is zero but for the reference's rounding
            assert np.abs(g).max() < tolerance, f"argument {k}: {np.abs(g).max():.2e}, not zero"
            continue
        assert relative_error(g, w) < tolerance, f"argument {k}: {relative_error(g, w):.2e}"
