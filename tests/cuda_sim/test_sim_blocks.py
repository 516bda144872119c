"""The simulator's blocks as the harness runs them, as generators in one thread (``sim_lanes``) and on
the simulator's threads (``sim_blocks``: a barrier that waits, threads kept between blocks), with the
simulator's own semantics otherwise."""

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


@pytest.mark.usefixtures("runner")
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


@pytest.mark.usefixtures("runner")
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


@pytest.mark.usefixtures("runner")
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


@pytest.mark.usefixtures("threads")
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


@pytest.mark.usefixtures("runner")
def test_block_votes_and_two_dimensional_thread_ids():
    out = np.zeros((4, 24), np.int32)
    _counts[1, (8, 3)](out)
    assert (out[0] == 8).all() and (out[1] == 1).all() and (out[2] == 1).all()
    assert out[3].tolist() == list(range(24))


@cuda.jit(device=True)
def _dim_after_a_barrier():
    cuda.syncthreads()
    return cuda.blockDim.x


@cuda.jit
def _fails_while_others_wait(out, fail):
    t = cuda.threadIdx.x
    if fail and t == cuda.blockDim.x - 1:
        raise ValueError("planted")
    out[t] = _dim_after_a_barrier()


@pytest.mark.usefixtures("runner")
def test_threads_of_a_failed_launch_leave_their_device_functions():
    """The other threads of a failed block wait inside a device function, whose ``cuda`` global is
    their launch's until they leave it: the next launch (16 threads a block, not 32) sees its own,
    while the failed launch's error, and the frames it holds, are still kept."""
    with pytest.raises(ValueError, match="planted") as failed:
        _fails_while_others_wait[1, 32](np.zeros(32, np.int64), 1)
    out = np.zeros(16, np.int64)
    _fails_while_others_wait[1, 16](out, 0)
    assert failed.value is not None and out.tolist() == [16] * 16


_HIDDEN = (_dim_after_a_barrier,)


@cuda.jit
def _barrier_through_a_tuple(out):
    out[cuda.threadIdx.x] = _HIDDEN[0]()


@pytest.mark.usefixtures("lanes")
def test_a_barrier_the_rewrite_cannot_see_is_an_error_not_a_hang():
    """A device function called through a tuple is not rewritten into the kernel's generator: its
    barrier, run as the simulator's, raises at once in the lanes' thread."""
    with pytest.raises(RuntimeError, match="a barrier reached through a call the rewrite could not follow"):
        _barrier_through_a_tuple[1, 32](np.zeros(32, np.int64))


def rounds_of_handover(store_warp: int, synchronised: bool):
    """Two rounds in which one warp stores a shared tile and the other loads it, a barrier after each
    round, and one between the store and the load if ``synchronised``."""

    @cuda.jit
    def kernel(src, out):
        tid = cuda.threadIdx.x
        lane = tid % 32
        tile = cuda.shared.array(32, np.float32)
        for r in range(2):
            if tid // 32 == store_warp:
                tile[lane] = src[32 * r + lane]
            if synchronised:
                cuda.syncthreads()
            if tid // 32 != store_warp:
                out[32 * r + lane] = tile[lane]
            cuda.syncthreads()

    return kernel


@pytest.mark.usefixtures("lanes")
@pytest.mark.parametrize("synchronised", [True, False], ids=["with-barrier", "without-barrier"])
@pytest.mark.parametrize("store_warp", [0, 1])
def test_a_missing_barrier_is_seen_whichever_warp_stores(store_warp, synchronised):
    """As generators, one warp runs at a time between barriers, the last first after an even number of
    barriers, the first after an odd number: the loading warp runs before the storing one in one of
    the two rounds (and reads poison, or the last round's tile), whichever warp stores."""
    src = np.arange(64, dtype=np.float32) + 1
    out = np.zeros(64, np.float32)
    rounds_of_handover(store_warp, synchronised)[1, 64](src, out)
    if synchronised:
        np.testing.assert_array_equal(out, src)
    else:
        assert not np.array_equal(out, src), "both rounds' loads came after the stores"


def simulator_threads() -> set:
    from numba.cuda.simulator.kernel import BlockThread

    return {t for t in threading.enumerate() if isinstance(t, BlockThread)}


@pytest.mark.usefixtures("threads")
def test_threads_are_kept_from_one_block_to_the_next():
    out = np.zeros((3, 64), np.float32)
    _rotate[3, 64](out, 1)
    kept = simulator_threads()
    assert len(kept) >= 64
    for _ in range(3):
        _rotate[3, 64](out, 1)
    assert simulator_threads() == kept
