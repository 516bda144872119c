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
    "L": 576,  # MLA's latent width: 512 and 64 rotary dimensions
    "QB": 19,  # a table of blocks of 16 (tests/passes/specs.py's block_table): T and S in blocks
    "KB": 17,
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


def test_offsets_past_two_to_the_31_on_the_device():
    """A [1, 1, T, T] float32 bias of T = 46341 on the GPU (8.6 GB, 2^31 + 2^16 elements): the
    kernel reads its last rows at flat offsets past 2^31."""
    from tests.e2e.test_gather_bounds import windowed_bias

    t = 46341
    bias = cuda.device_array((1, 1, t, t), dtype=np.float32)
    rows = np.zeros((2, t), dtype=np.float32)
    rows[0, [t - 3, t - 2]] = [-1.0, 4.0]
    rows[1, [t - 2, t - 1]] = [3.0, -2.0]
    bias[0, 0, t - 2 :, :].copy_to_device(rows)
    rng = np.random.default_rng(7)
    q, k, v = (rng.standard_normal((1, 1, t, 4)).astype(np.float32) for _ in range(3))
    out = ac.compile(windowed_bias, backend="cuda")(q, k, v, bias)
    out = out.copy_to_host() if hasattr(out, "copy_to_host") else out
    for row, values in ((t - 2, rows[0]), (t - 1, rows[1])):
        keys = [row - 1, row]
        s = q[0, 0, row] @ k[0, 0, keys].T * 0.5 + values[keys].astype(np.float64)
        p = np.exp(s - s.max())
        np.testing.assert_allclose(out[0, 0, row], (p / p.sum()) @ v[0, 0, keys], rtol=1e-5, atol=1e-6)
    del bias
