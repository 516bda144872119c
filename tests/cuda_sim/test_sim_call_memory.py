"""A call's device memory from the caller's allocator (``Program.on_stream(handle, allocate)``), as
``fn.to_torch()`` takes it from PyTorch's caching allocator: every allocation of the call's results
and workspace goes through it, in the simulator."""

from __future__ import annotations

import contextlib

import ml_dtypes
import numpy as np
import pytest
from numba import cuda

import attncomp as ac
from attncomp.backends.numba_cuda.host import arrays
from attncomp.backends.numba_cuda.host.launches import on_stream
from attncomp.testing import relative_error
from tests.cuda_sim.helpers import normal
from tests.passes.specs import generic_alibi as alibi

PIPELINE = "cse,softmax-fusion,flash-tiling{block_q=4,block_k=4},mask-elimination,canonicalize,cse,dce"


class Given:
    """An allocator as PyTorch's: arrays of the asked shape, 16-bit patterns as int16 (torch has no
    uint16 tensors to speak of); each one it gave is kept, with the number of Numba's own allocations
    made while it was in use."""

    def __init__(self) -> None:
        self.arrays: list = []
        self.numbas = 0
        self.inside = False

    def __call__(self, shape: tuple[int, ...], dtype: np.dtype):
        self.inside = True
        try:
            array = cuda.device_array(shape, dtype=np.int16 if dtype == np.uint16 else dtype)
        finally:
            self.inside = False
        self.arrays.append(array)
        return array

    @contextlib.contextmanager
    def counting(self, monkeypatch):
        """Numba's allocations that are not this allocator's own, counted in ``numbas``."""
        original = cuda.device_array

        def device_array(*args, **kwargs):
            if not self.inside:
                self.numbas += 1
            return original(*args, **kwargs)

        with monkeypatch.context() as patched:
            patched.setattr(cuda, "device_array", device_array)
            yield

    def gave(self, result) -> bool:
        """Whether ``result`` lies in memory this allocator gave (a view of it, a 16-bit one included)."""
        memory = np.asarray(result._ary) if hasattr(result, "_ary") else np.asarray(result)
        return any(np.shares_memory(memory, np.asarray(a._ary)) for a in self.arrays)


def tokens(rng, n: int) -> list[np.ndarray]:
    return [normal(rng, 1, 2, n, 8) for _ in range(3)] + [np.array([0.5, 0.25], dtype=np.float32)]


def test_a_forward_and_its_gradients_take_every_allocation_from_the_callers(monkeypatch):
    rng = np.random.default_rng(3)
    args = [cuda.to_device(x) for x in tokens(rng, 13)]
    fn = ac.compile(alibi, backend="cuda", pipeline=PIPELINE)
    d_out = cuda.to_device(normal(rng, 1, 2, 13, 8))
    want_out, pullback = fn.vjp(*args)
    want = pullback(d_out)
    given = Given()
    with given.counting(monkeypatch), on_stream(cuda.stream(), given):
        out, pullback = fn.vjp(*args)
        grads = pullback(d_out)
    assert given.numbas == 0 and len(given.arrays) >= 4  # the output, its log-sum-exp, the gradients
    assert given.gave(out) and all(given.gave(g) for g in grads)
    assert relative_error(out.copy_to_host(), want_out.copy_to_host()) < 1e-6
    for g, w in zip(grads, want):  # atomics add in any order: equal up to float32 rounding
        assert relative_error(g.copy_to_host(), w.copy_to_host()) < 1e-6


def test_bf16_patterns_come_in_the_callers_16_bit_memory(monkeypatch):
    """bf16 results are written as patterns into memory the allocator gave as int16, viewed as uint16."""
    rng = np.random.default_rng(4)
    bf16 = ac.compile(alibi, backend="cuda", pipeline=PIPELINE).for_dtype("bf16").compilation
    host = [x.astype(ml_dtypes.bfloat16) for x in tokens(rng, 9)]
    want = bf16.run(host)[0]
    on_device = [arrays.Bf16Bits(cuda.to_device(x.view(np.uint16))) for x in host]
    given = Given()
    with given.counting(monkeypatch), on_stream(cuda.stream(), given):
        got = bf16.run(on_device)[0]
    assert isinstance(got, arrays.Bf16Bits) and got.bits.dtype == np.uint16 and given.gave(got.bits)
    assert given.numbas == 0
    np.testing.assert_array_equal(got.copy_to_host().view(np.uint16), want.view(np.uint16))


def test_what_the_allocator_declines_numba_allocates_and_a_wrong_array_is_refused():
    rng = np.random.default_rng(5)
    args = [cuda.to_device(x) for x in tokens(rng, 6)]
    fn = ac.compile(alibi, backend="cuda", pipeline=PIPELINE)
    want = fn(*args).copy_to_host()
    with on_stream(0, lambda shape, dtype: None):  # torch's allocator has no tensors of some types
        np.testing.assert_array_equal(fn(*args).copy_to_host(), want)

    def wrong(shape, dtype):
        return cuda.device_array((*shape, 2), dtype=dtype)

    with on_stream(0, wrong), pytest.raises(ValueError, match=r"the call's allocator gave \(1, 2, 6, 8, 2\)"):
        fn(*args)
