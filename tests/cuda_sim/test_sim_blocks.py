"""The simulator's blocks as ``sim_blocks`` runs them: a barrier that waits, threads kept between
blocks, and the simulator's own semantics otherwise."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
from numba import cuda

pytestmark = pytest.mark.skipif(
    os.environ.get("NUMBA_ENABLE_CUDASIM") != "1", reason="the simulator's blocks (a GPU runs its own)"
)


@cuda.jit
def _rotate(out, rounds):
    """Each round, every thread reads its neighbour's value from shared memory, written by another
    warp for the last lanes: wrong without both barriers."""
    values = cuda.shared.array(64, np.float32)
    t = cuda.threadIdx.x
    n = cuda.blockDim.x
    value = np.float32(cuda.blockIdx.x * 1000 + t)
    for _ in range(rounds):
        values[t] = value
        cuda.syncthreads()
        value = values[(t + 1) % n]
        cuda.syncthreads()
    out[cuda.blockIdx.x, t] = value


def test_barriers_order_shared_memory_across_warps_in_every_block():
    out = np.zeros((3, 64), np.float32)
    _rotate[3, 64](out, 5)
    want = np.array([[b * 1000 + (t + 5) % 64 for t in range(64)] for b in range(3)], np.float32)
    assert np.array_equal(out, want)


@cuda.jit
def _early_exit(out):
    t = cuda.threadIdx.x
    if t >= 4:
        return
    cuda.syncthreads()
    out[t] = t + 1


def test_threads_that_have_returned_no_longer_hold_the_barrier():
    out = np.zeros(8, np.int32)
    _early_exit[2, 8](out)
    assert out.tolist() == [1, 2, 3, 4, 0, 0, 0, 0]


@cuda.jit
def _raise_in_one_thread(out):
    t = cuda.threadIdx.x
    cuda.syncthreads()
    if t == 5 and cuda.blockIdx.x == 1:
        raise ValueError("planted")
    cuda.syncthreads()
    out[cuda.blockIdx.x, t] = 1


def test_an_exception_in_one_thread_is_raised_from_the_launch_and_the_next_launch_runs():
    out = np.zeros((2, 16), np.int32)
    with pytest.raises(ValueError, match=r"tid=\[5, 0, 0\] ctaid=\[1, 0, 0\]: planted"):
        _raise_in_one_thread[2, 16](out)
    out = np.zeros((3, 64), np.float32)
    _rotate[3, 64](out, 2)
    assert out[2, 63] == 2000 + 1


@cuda.jit
def _raise_while_others_work(out, rounds):
    t = cuda.threadIdx.x
    if t == 0:
        raise ValueError("planted")
    total = 0
    for i in range(rounds):
        total += i
    cuda.syncthreads()
    out[t] = total


def test_a_failed_launch_returns_once_its_other_threads_have_stopped():
    """Else a thread of the failed launch, still inside a device function, would hold that function's
    ``cuda`` global at its launch's while the next launch's threads call it (``mma/warp_sim.py`` finds
    a launch's warps by it)."""
    out = np.zeros(32, np.int64)
    with pytest.raises(ValueError, match="planted"):
        _raise_while_others_work[1, 32](out, 100_000)
    assert not any(t.is_alive() for t in simulator_threads())


@cuda.jit
def _counts(out):
    t = cuda.threadIdx.x + cuda.blockDim.x * cuda.threadIdx.y
    out[0, t] = cuda.syncthreads_count(t % 3 == 0)
    out[1, t] = cuda.syncthreads_and(t < 100)
    out[2, t] = cuda.syncthreads_or(t == 7)
    out[3, t] = t


def test_block_votes_and_two_dimensional_thread_ids():
    out = np.zeros((4, 24), np.int32)
    _counts[1, (8, 3)](out)
    assert (out[0] == 8).all() and (out[1] == 1).all() and (out[2] == 1).all()
    assert out[3].tolist() == list(range(24))


def simulator_threads() -> set:
    from numba.cuda.simulator.kernel import BlockThread

    return {t for t in threading.enumerate() if isinstance(t, BlockThread)}


def test_threads_are_kept_from_one_block_to_the_next():
    out = np.zeros((3, 64), np.float32)
    _rotate[3, 64](out, 1)
    kept = simulator_threads()
    assert len(kept) >= 64
    for _ in range(3):
        _rotate[3, 64](out, 1)
    assert simulator_threads() == kept
