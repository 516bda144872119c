"""The simulator's memory as ``sim_memory`` sets it up: unwritten memory reads as poison."""

from __future__ import annotations

import os

import numpy as np
import pytest
from numba import cuda

pytestmark = pytest.mark.skipif(
    os.environ.get("NUMBA_ENABLE_CUDASIM") != "1", reason="the simulator's memory (a GPU's is not poisoned)"
)


@cuda.jit
def _half_written(out, ints):
    values = cuda.shared.array(8, np.float32)
    counts = cuda.shared.array(8, np.int32)
    t = cuda.threadIdx.x
    if t < 4:
        values[t] = t
        counts[t] = 2 * t
    cuda.syncthreads()
    out[t] = values[7 - t]
    ints[t] = counts[t]


def test_unwritten_shared_memory_reads_as_poison_and_each_declaration_is_its_own():
    out = np.zeros(8, np.float32)
    ints = np.zeros(8, np.int32)
    _half_written[1, 8](out, ints)
    assert np.isnan(out[:4]).all() and np.array_equal(out[4:], [3, 2, 1, 0])
    assert np.array_equal(ints[:4], [0, 2, 4, 6]) and (ints[4:] == np.iinfo(np.int32).max).all()


def test_device_arrays_start_poisoned():
    assert np.isnan(cuda.device_array(3, np.float32).copy_to_host()).all()
    assert (cuda.device_array(2, np.uint16).copy_to_host() == 0xFFFF).all()
