"""The simulator's warp instructions (``mma/warp_sim.py``) synchronise their warp, not the block.

An emulated ``mma`` or shuffle waits for the lanes of its own warp only, as on the GPU: a kernel
that lacks a ``cuda.syncthreads`` between one warp's stores to shared memory and another warp's
loads reads memory nobody wrote (poisoned by ``sim_memory.py``), so the missing barrier fails
here.  Partial warps, several blocks, instructions back to back, one product per warp, and lanes
that cannot come to an instruction are covered too.
"""

import os
import threading

import numpy as np
import pytest
from numba import cuda

from attncomp.backends.numba_cuda.warp import mma_f16, quad_max, quad_sum, shuffle_xor

pytestmark = [
    pytest.mark.skipif(
        os.environ.get("NUMBA_ENABLE_CUDASIM") != "1", reason="the simulator's emulation of warp instructions"
    ),
    pytest.mark.usefixtures("runner"),
]

#: the longest the storing warp holds its stores for the loading warp (seconds)
HOLD = 10.0


def handover(synchronised: bool, loaded: list):
    """A kernel of two warps: the first stores a shared tile, the second runs a warp instruction
    (``quad_sum``) and loads the tile, with or without a ``cuda.syncthreads`` between.

    Without the barrier the first warp holds its stores until the second has loaded (``loaded``,
    an event per lane; at most ``HOLD`` seconds): nothing orders them, and a warp instruction that
    synchronised the whole block would make the loads wait for the stores instead."""

    @cuda.jit
    def kernel(src, sums, out):
        tid = cuda.threadIdx.x
        lane = tid % 32
        tile = cuda.shared.array(32, np.float32)
        if tid < 32:
            if not synchronised:
                loaded[lane].wait(HOLD)
            tile[lane] = src[lane]
        if synchronised:
            cuda.syncthreads()
        if tid >= 32:
            sums[lane] = quad_sum(src[lane])
            out[lane] = tile[lane]
            if not synchronised:
                loaded[lane].set()

    return kernel


@pytest.mark.parametrize("synchronised", [True, False], ids=["with-barrier", "without-barrier"])
def test_a_missing_barrier_between_warps_fails(synchronised):
    src = np.arange(32, dtype=np.float32) + 1
    sums, out = np.zeros(32, np.float32), np.zeros(32, np.float32)
    handover(synchronised, [threading.Event() for _ in range(32)])[1, 64](src, sums, out)
    np.testing.assert_array_equal(sums, np.repeat(src.reshape(8, 4).sum(1), 4))
    if synchronised:
        np.testing.assert_array_equal(out, src)
    else:  # the loads came before the stores: the tile's poison
        assert np.isnan(out).all(), f"the loads saw stores that no barrier ordered before them: {out}"


@cuda.jit
def shuffles(x, sums, maxima, swapped, rounds):
    i = cuda.grid(1)
    sums[i] = quad_sum(x[i])
    maxima[i] = quad_max(x[i])
    y = x[i]
    for r in range(rounds.size):  # instructions back to back, each with its own values
        y = shuffle_xor(y + np.float32(r), rounds[r])
    swapped[i] = y


def shuffled(x: np.ndarray, rounds: np.ndarray) -> np.ndarray:
    """What ``shuffles`` leaves in ``swapped`` for one block's ``x``."""
    lane = np.arange(x.size) % 32
    base = np.arange(x.size) - lane
    y = x.copy()
    for r, mask in enumerate(rounds):
        y = (y + np.float32(r))[base + (lane ^ mask)]
    return y


@pytest.mark.parametrize("blocks,threads", [(1, 32), (3, 64), (2, 48)], ids=["one-warp", "blocks", "partial-warp"])
def test_shuffles_by_warp(blocks, threads):
    """Quad reductions and butterfly shuffles in every warp of every block, the last warp of a
    48-thread block with 16 lanes (its shuffles stay within its 16 lanes)."""
    rng = np.random.default_rng(threads)
    n = blocks * threads
    x = rng.standard_normal(n).astype(np.float32)
    rounds = rng.integers(1, 16, 40).astype(np.int32)
    sums, maxima, swapped = (np.zeros(n, np.float32) for _ in range(3))
    shuffles[blocks, threads](x, sums, maxima, swapped, rounds)
    quads = x.reshape(-1, 4)
    np.testing.assert_array_equal(maxima, np.repeat(quads.max(1), 4))
    pairs = quads + quads[:, [1, 0, 3, 2]]  # lane l: x[l] + x[l ^ 1], then that plus lane l ^ 2's, in float32
    np.testing.assert_array_equal(sums, (pairs + pairs[:, [2, 3, 0, 1]]).ravel())
    np.testing.assert_array_equal(swapped, np.concatenate([shuffled(xb, rounds) for xb in x.reshape(blocks, -1)]))


@cuda.jit
def products(a, b, out):
    """Warp ``w`` multiplies ``a[w]`` (16 x 16 float16 bits) by ``b[w]`` (16 x 8)."""
    tid = cuda.threadIdx.x
    w, lane = tid // 32, tid % 32
    g, t2 = lane // 4, 2 * (lane % 4)
    regs = []
    for row, col in ((g, t2), (g + 8, t2), (g, t2 + 8), (g + 8, t2 + 8)):
        regs.append(np.uint32(a[w, row, col]) | (np.uint32(a[w, row, col + 1]) << np.uint32(16)))
    for row in (t2, t2 + 8):
        regs.append(np.uint32(b[w, row, g]) | (np.uint32(b[w, row + 1, g]) << np.uint32(16)))
    zero = np.float32(0.0)
    d = mma_f16(regs[0], regs[1], regs[2], regs[3], regs[4], regs[5], zero, zero, zero, zero)
    for k, (row, col) in enumerate(((g, t2), (g, t2 + 1), (g + 8, t2), (g + 8, t2 + 1))):
        out[w, row, col] = d[k]


def test_each_warp_computes_its_product_once(monkeypatch):
    from attncomp.backends.numba_cuda.mma import warp_sim

    computed = []
    product = warp_sim._mma_f16

    def counted(rows):
        computed.append(threading.current_thread().thread_id // 32)
        return product(rows)

    monkeypatch.setattr(warp_sim, "_mma_f16", counted)
    rng = np.random.default_rng(5)
    a = rng.standard_normal((3, 16, 16)).astype(np.float16)
    b = rng.standard_normal((3, 16, 8)).astype(np.float16)
    out = np.zeros((3, 16, 8), np.float32)
    products[1, 96](a.view(np.uint16), b.view(np.uint16), out)
    assert sorted(computed) == [0, 1, 2]  # one product a warp, by one of its lanes
    np.testing.assert_allclose(out, a.astype(np.float64) @ b.astype(np.float64), rtol=1e-5, atol=1e-5)


@cuda.jit
def exits(x, out):
    lane = cuda.threadIdx.x
    if lane >= 16:
        return
    out[lane] = quad_sum(x[lane])


@cuda.jit
def waits_at_barrier(x, out):
    lane = cuda.threadIdx.x
    if lane == 31:
        cuda.syncthreads()
    else:
        out[lane] = quad_sum(x[lane])
        cuda.syncthreads()


@cuda.jit
def diverges(x, out):
    lane = cuda.threadIdx.x
    out[lane] = quad_sum(x[lane]) if lane < 16 else quad_max(x[lane])


@pytest.mark.parametrize(
    "kernel,message",
    [
        (exits, "lane 16 of warp 0 has exited before a warp instruction"),
        (waits_at_barrier, "lane 31 of warp 0 waits at syncthreads while its warp waits at a warp instruction"),
        (diverges, r"lane \d+ of warp 0 is at _quad_(sum|max), its warp at _quad_(sum|max)"),
    ],
    ids=["exited", "at-syncthreads", "other-instruction"],
)
def test_a_lane_missing_from_a_warp_instruction_is_an_error(kernel, message):
    """The GPU leaves these undefined (``shfl.sync`` and ``mma.sync`` need the whole warp); the
    simulator reports them instead of waiting for ever."""
    x = np.ones(32, np.float32)
    with pytest.raises(RuntimeError, match=message):
        kernel[1, 32](x, np.zeros(32, np.float32))
