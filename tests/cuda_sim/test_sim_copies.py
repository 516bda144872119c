"""The shared-memory instructions ``ldmatrix`` and ``cp.async``: the simulator's emulation
(``mma/warp_sim.py``), and the layouts on a GPU too.

``ldmatrix_x4`` (``.trans``) is checked against the PTX ISA's layout written out here with plain
arithmetic, and as the B operand of ``mma``: a row-major K tile gives ``Q K^T``, a row-major V
tile through ``.trans`` gives ``P V``.  ``cp_async16`` writes shared memory only at the issuing
thread's ``cp_async_wait`` (never at the call, never for another block), zero-fills past
``src_bytes`` and reads a flat offset of any source; a missing ``syncthreads`` after the wait
leaves another warp reading stale memory.  The bank counts follow ``bank_counts``'s model.
"""

import os
import threading

import ml_dtypes
import numpy as np
import pytest
from numba import cuda

from attncomp.backends.numba_cuda.mma.atoms import CP_ASYNC_16, LDMATRIX_X4, LDMATRIX_X4_TRANS
from attncomp.backends.numba_cuda.mma.warp_sim_copies import bank_counts, reset_bank_counts
from attncomp.backends.numba_cuda.warp import (
    cp_async16,
    cp_async_commit,
    cp_async_wait,
    ldmatrix_x4,
    ldmatrix_x4_trans,
    mma_bf16,
)

#: what only the emulation shows (when a copy lands, bank counts); the layout tests also run on a
#: GPU (``ATTNCOMP_TEST_GPU=1``), where the same kernels run the PTX
SIMULATOR_ONLY = pytest.mark.skipif(
    os.environ.get("NUMBA_ENABLE_CUDASIM") != "1", reason="the simulator's emulation of warp instructions"
)

#: the longest the copying warp holds its wait for the reading warp (seconds)
HOLD = 10.0


def ldmatrix_expected(rows: np.ndarray, trans: bool) -> np.ndarray:
    """Every lane's 4 registers (32 x 4, uint32) when lane ``l`` gives the address of ``rows[l]``
    (32 rows of 8 uint16): matrix ``j`` is rows ``8 j .. 8 j + 7``; lane ``l`` holds its row
    ``l // 4``, elements ``2 (l % 4)`` and ``2 (l % 4) + 1`` (low half first), or with ``.trans``
    its elements ``(2 (l % 4), l // 4)`` and ``(2 (l % 4) + 1, l // 4)``."""
    out = np.zeros((32, 4), np.uint32)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for j in range(4):
            matrix = rows[8 * j : 8 * j + 8]
            lo, hi = (matrix[2 * t, g], matrix[2 * t + 1, g]) if trans else (matrix[g, 2 * t], matrix[g, 2 * t + 1])
            out[lane, j] = int(lo) | (int(hi) << 16)
    return out


@cuda.jit
def load_rows(tile, order, plain, trans):
    """Lane ``l`` gives the address of row ``order[l]`` of a shared copy of ``tile`` (32 rows of 16 bytes)."""
    lane = cuda.threadIdx.x
    sh = cuda.shared.array(128, np.uint32)
    for i in range(4):
        sh[4 * lane + i] = tile[4 * lane + i]
    cuda.syncthreads()
    regs = ldmatrix_x4(sh, 16 * order[lane])
    regs_t = ldmatrix_x4_trans(sh, 16 * order[lane])
    for j in range(4):
        plain[lane, j] = regs[j]
        trans[lane, j] = regs_t[j]


def test_ldmatrix_places_match_the_ptx_layout():
    rng = np.random.default_rng(1)
    elements = rng.permutation(2**16)[: 32 * 8].astype(np.uint16).reshape(32, 8)  # distinct
    order = rng.permutation(32).astype(np.int32)
    plain, trans = np.zeros((32, 4), np.uint32), np.zeros((32, 4), np.uint32)
    load_rows[1, 32](elements.view(np.uint32).ravel(), order, plain, trans)
    np.testing.assert_array_equal(plain, ldmatrix_expected(elements[order], trans=False))
    np.testing.assert_array_equal(trans, ldmatrix_expected(elements[order], trans=True))


@cuda.jit
def attention_products(q, k_words, p, v_words, s_out, o_out):
    """``Q K^T`` with K's B fragments from ``ldmatrix`` of its row-major tile (rows n, columns k),
    ``P V`` with V's from ``ldmatrix.trans`` of its row-major tile (rows k); 16 x 16 bf16 each."""
    lane = cuda.threadIdx.x
    g, t2 = lane // 4, 2 * (lane % 4)
    ks = cuda.shared.array(128, np.uint32)
    vs = cuda.shared.array(128, np.uint32)
    for i in range(4):
        ks[4 * lane + i] = k_words[4 * lane + i]
        vs[4 * lane + i] = v_words[4 * lane + i]
    cuda.syncthreads()
    j, r = lane // 8, lane % 8
    # K: matrices (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15): b0, b1 of each n tile
    kb = ldmatrix_x4(ks, ((j // 2) * 8 + r) * 32 + (j % 2) * 16)
    # V: matrices (k 0-7, n 0-7), (k 8-15, n 0-7), (k 0-7, n 8-15), (k 8-15, n 8-15)
    vb = ldmatrix_x4_trans(vs, ((j % 2) * 8 + r) * 32 + (j // 2) * 16)
    tile_products(q, kb, s_out, g, t2)
    tile_products(p, vb, o_out, g, t2)


@cuda.jit(device=True)
def pair(a, row, col):
    """Two bf16 of one row as one A-fragment register (low half first), as a GPU compiles it."""
    return np.uint32(a[row, col]) | (np.uint32(a[row, col + 1]) << np.uint32(16))


@cuda.jit(device=True)
def tile_products(a, b, out, g, t2):
    """``a (16 x 16) @ b`` for b's two 8-column n tiles, written into ``out`` by the C layout."""
    a0, a1, a2, a3 = pair(a, g, t2), pair(a, g + 8, t2), pair(a, g, t2 + 8), pair(a, g + 8, t2 + 8)
    zero = np.float32(0.0)
    d = mma_bf16(a0, a1, a2, a3, b[0], b[1], zero, zero, zero, zero)
    out[g, t2], out[g, t2 + 1], out[g + 8, t2], out[g + 8, t2 + 1] = d[0], d[1], d[2], d[3]
    d = mma_bf16(a0, a1, a2, a3, b[2], b[3], zero, zero, zero, zero)
    out[g, 8 + t2], out[g, 9 + t2], out[g + 8, 8 + t2], out[g + 8, 9 + t2] = d[0], d[1], d[2], d[3]


def test_ldmatrix_gives_b_fragments_of_mma():
    rng = np.random.default_rng(2)
    q, k, p, v = (rng.standard_normal((16, 16)).astype(ml_dtypes.bfloat16) for _ in range(4))
    s, o = np.zeros((16, 16), np.float32), np.zeros((16, 16), np.float32)
    bits = [x.view(np.uint16) for x in (q, k, p, v)]
    attention_products[1, 32](bits[0], bits[1].view(np.uint32).ravel(), bits[2], bits[3].view(np.uint32).ravel(), s, o)
    q, k, p, v = (x.astype(np.float64) for x in (q, k, p, v))
    np.testing.assert_allclose(s, q @ k.T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(o, p @ v, rtol=1e-5, atol=1e-5)


#: the words a thread's 16-byte chunk holds before its copy lands
OLD = np.uint32(0x0BAD0000)


@cuda.jit
def copy_and_wait(src, sizes, before, after):
    """Lane ``l`` copies ``sizes[l]`` bytes of chunk ``l`` of ``src`` into its chunk of shared memory."""
    lane = cuda.threadIdx.x
    sh = cuda.shared.array(128, np.uint32)
    for i in range(4):
        sh[4 * lane + i] = OLD + np.uint32(4 * lane + i)
    cp_async16(sh, 16 * lane, src, 8 * lane, sizes[lane])
    cp_async_commit()
    for i in range(4):
        before[4 * lane + i] = sh[4 * lane + i]
    cp_async_wait(0)
    for i in range(4):
        after[4 * lane + i] = sh[4 * lane + i]


@SIMULATOR_ONLY
def test_copies_land_at_the_wait_and_zero_fill():
    src = np.arange(1, 257, dtype=np.uint16) * 3
    sizes = np.where(np.arange(32) % 2, 0, 16).astype(np.int32)  # odd lanes: 16 zero bytes
    sizes[4] = 6  # 6 bytes read, 10 zero-filled
    before, after = np.zeros(128, np.uint32), np.zeros(128, np.uint32)
    copy_and_wait[1, 32](src, sizes, before, after)
    np.testing.assert_array_equal(before, OLD + np.arange(128, dtype=np.uint32))
    expected = src.reshape(32, 8).copy()
    expected[np.arange(32) % 2 == 1] = 0
    expected[4, 3:] = 0
    np.testing.assert_array_equal(after, expected.view(np.uint32).ravel())


@cuda.jit
def copy_past_the_end(src, sizes, after):
    """Lane ``l`` copies ``sizes[l]`` bytes of chunk ``l`` of ``src``, which has 16 chunks: lanes 16 ..
    address chunks past its end, as a tile's rows past the last key do."""
    lane = cuda.threadIdx.x
    sh = cuda.shared.array(128, np.uint32)
    for i in range(4):
        sh[4 * lane + i] = OLD
    cp_async16(sh, 16 * lane, src, 8 * lane, sizes[lane])
    cp_async_commit()
    cp_async_wait(0)
    for i in range(4):
        after[4 * lane + i] = sh[4 * lane + i]


@SIMULATOR_ONLY
def test_a_copy_that_reads_nothing_may_address_past_the_array():
    """``src_size`` 0 reads nothing (the instruction's ignore-src form), so the kernels give a row past
    the end the address of its constant step, not the last row's; a copy that reads bytes there is
    out of bounds."""
    src = np.arange(1, 129, dtype=np.uint16)
    sizes = np.where(np.arange(32) < 16, 16, 0).astype(np.int32)
    after = np.zeros(128, np.uint32)
    copy_past_the_end[1, 32](src, sizes, after)
    np.testing.assert_array_equal(after[:64], src.view(np.uint32))
    np.testing.assert_array_equal(after[64:], 0)  # zero-filled
    sizes[20] = 2
    with pytest.raises(IndexError, match="cp.async source"):
        copy_past_the_end[1, 32](src, sizes, after)


@cuda.jit
def two_groups(src, first, second):
    """Group 1 copies chunk ``l`` of ``src`` into ``a``, group 2 chunk ``l + 32`` into ``b``; ``wait(1)``
    completes group 1 only."""
    lane = cuda.threadIdx.x
    a = cuda.shared.array(128, np.uint32)
    b = cuda.shared.array(128, np.uint32)
    for i in range(4):
        a[4 * lane + i] = OLD
        b[4 * lane + i] = OLD
    cp_async16(a, 16 * lane, src, 8 * lane, 16)
    cp_async_commit()
    cp_async16(b, 16 * lane, src, 8 * (lane + 32), 16)
    cp_async_commit()
    cp_async_wait(1)
    for i in range(4):
        first[0, 4 * lane + i] = a[4 * lane + i]
        first[1, 4 * lane + i] = b[4 * lane + i]
    cp_async_wait(0)
    for i in range(4):
        second[0, 4 * lane + i] = a[4 * lane + i]
        second[1, 4 * lane + i] = b[4 * lane + i]


@SIMULATOR_ONLY
def test_wait_leaves_the_newest_groups_pending():
    src = np.arange(512, dtype=np.uint16) + 7
    first, second = np.zeros((2, 128), np.uint32), np.zeros((2, 128), np.uint32)
    two_groups[1, 32](src, first, second)
    words = src.view(np.uint32).reshape(2, 128)
    np.testing.assert_array_equal(first[0], words[0])
    np.testing.assert_array_equal(first[1], np.full(128, OLD))  # the newest group: still pending
    np.testing.assert_array_equal(second, words)


@cuda.jit
def copy_flat(src, whole, part):
    """Lane ``l`` copies flat chunk ``2 l + 1`` of ``src`` (2 x 4 x 64 float16) and chunk ``l`` of ``src[1]``."""
    lane = cuda.threadIdx.x
    a = cuda.shared.array(128, np.uint32)
    b = cuda.shared.array(128, np.uint32)
    cp_async16(a, 16 * lane, src, 8 * (2 * lane + 1), 16)
    cp_async16(b, 16 * lane, src[1], 8 * lane, 16)
    cp_async_commit()
    cp_async_wait(0)
    for i in range(4):
        whole[4 * lane + i] = a[4 * lane + i]
        part[4 * lane + i] = b[4 * lane + i]


@SIMULATOR_ONLY
def test_copies_from_a_flat_offset_of_a_float16_array():
    src = np.random.default_rng(3).standard_normal((2, 4, 64)).astype(np.float16)
    whole, part = np.zeros(128, np.uint32), np.zeros(128, np.uint32)
    copy_flat[1, 32](src, whole, part)
    chunks = src.reshape(64, 8)
    np.testing.assert_array_equal(whole.view(np.float16).reshape(32, 8), chunks[1::2])
    np.testing.assert_array_equal(part.view(np.float16).reshape(32, 8), chunks[32:])


@cuda.jit
def left_pending(src, out):
    """Block 0 issues and commits copies but never waits; block 1 only waits: nothing of block 0's lands."""
    lane = cuda.threadIdx.x
    sh = cuda.shared.array(128, np.uint32)
    if cuda.blockIdx.x == 0:
        cp_async16(sh, 16 * lane, src, 8 * lane, 16)
        cp_async_commit()
    else:
        for i in range(4):
            sh[4 * lane + i] = OLD
        cp_async_wait(0)
        for i in range(4):
            out[4 * lane + i] = sh[4 * lane + i]


@SIMULATOR_ONLY
def test_pending_copies_stay_with_their_block():
    src = np.arange(256, dtype=np.uint16)
    for _ in range(2):  # and with their launch
        out = np.zeros(128, np.uint32)
        left_pending[2, 32](src, out)
        np.testing.assert_array_equal(out, np.full(128, OLD))


def handover(synchronised: bool, loaded: list):
    """Warp 0 copies chunk ``l`` of ``src`` into shared memory and waits for it; warp 1 reads the
    chunks, with or without a ``cuda.syncthreads`` after the wait.

    Without the barrier warp 0 holds its wait until warp 1 has read (``loaded``, an event per lane;
    at most ``HOLD`` seconds): nothing orders them, and the copy lands only at the wait."""

    @cuda.jit
    def kernel(src, out):
        tid = cuda.threadIdx.x
        lane = tid % 32
        sh = cuda.shared.array(128, np.uint32)
        if tid < 32:
            for i in range(4):
                sh[4 * lane + i] = OLD
        cuda.syncthreads()
        if tid < 32:
            cp_async16(sh, 16 * lane, src, 8 * lane, 16)
            cp_async_commit()
            if not synchronised:
                loaded[lane].wait(HOLD)
        cp_async_wait(0)
        if synchronised:
            cuda.syncthreads()
        if tid >= 32:
            for i in range(4):
                out[4 * lane + i] = sh[4 * lane + i]
            if not synchronised:
                loaded[lane].set()

    return kernel


@SIMULATOR_ONLY
@pytest.mark.usefixtures("threads")  # its warps are ordered by events, which block a thread
@pytest.mark.parametrize("synchronised", [True, False], ids=["with-barrier", "without-barrier"])
def test_a_missing_barrier_after_the_wait_reads_stale_memory(synchronised):
    src = np.arange(256, dtype=np.uint16) + 1
    out = np.zeros(128, np.uint32)
    handover(synchronised, [threading.Event() for _ in range(32)])[1, 64](src, out)
    np.testing.assert_array_equal(out, src.view(np.uint32) if synchronised else np.full(128, OLD))


def pitched_load(swizzled: bool):
    """Lane ``l`` loads chunk 0 of row ``l`` of a 32 x 128-byte tile (rows 128 bytes apart), stored
    plainly or with chunk ``c`` of row ``r`` at chunk ``c ^ (r % 8)``."""

    @cuda.jit
    def kernel(tile, plain, trans):
        lane = cuda.threadIdx.x
        sh = cuda.shared.array(1024, np.uint32)
        s = lane % 8 if swizzled else 0
        for c in range(8):
            for w in range(4):
                sh[32 * lane + 4 * (c ^ s) + w] = tile[lane, 4 * c + w]
        cuda.syncthreads()
        regs = ldmatrix_x4(sh, 128 * lane + 16 * s)
        regs_t = ldmatrix_x4_trans(sh, 128 * lane + 16 * s)
        for j in range(4):
            plain[lane, j] = regs[j]
            trans[lane, j] = regs_t[j]

    return kernel


@SIMULATOR_ONLY
@pytest.mark.parametrize("swizzled,conflicts", [(False, 4 * 7), (True, 0)], ids=["pitch-128", "swizzled"])
def test_ldmatrix_bank_conflicts(swizzled, conflicts):
    """Unswizzled, a matrix's 8 rows fall in the same 4 banks: 8 passes, 7 conflicts, for each of 4 matrices."""
    tile = np.arange(32 * 32, dtype=np.uint32).reshape(32, 32) * np.uint32(0x00010001) + np.uint32(0x10000)
    plain, trans = np.zeros((32, 4), np.uint32), np.zeros((32, 4), np.uint32)
    reset_bank_counts()
    pitched_load(swizzled)[1, 32](tile, plain, trans)
    counts = bank_counts()
    assert counts[LDMATRIX_X4.name] == counts[LDMATRIX_X4_TRANS.name] == (1, conflicts)
    assert counts[CP_ASYNC_16.name] == (0, 0)
    rows = tile[:, :4].copy().view(np.uint16)  # chunk 0 of each row: 8 elements
    np.testing.assert_array_equal(plain, ldmatrix_expected(rows, trans=False))
    np.testing.assert_array_equal(trans, ldmatrix_expected(rows, trans=True))


@SIMULATOR_ONLY
def test_ldmatrix_rows_given_twice_are_broadcast():
    """Every matrix's 8 lanes give rows 0 and 8 only (128 bytes apart: the same banks): two distinct
    words a bank, 2 passes, 1 conflict a matrix."""
    elements = np.arange(32 * 8, dtype=np.uint16).reshape(32, 8)
    order = 8 * (np.arange(32, dtype=np.int32) % 2)
    plain, trans = np.zeros((32, 4), np.uint32), np.zeros((32, 4), np.uint32)
    reset_bank_counts()
    load_rows[1, 32](elements.view(np.uint32).ravel(), order, plain, trans)
    counts = bank_counts()
    assert counts[LDMATRIX_X4.name] == counts[LDMATRIX_X4_TRANS.name] == (1, 4)
    np.testing.assert_array_equal(plain, ldmatrix_expected(elements[order], trans=False))


@cuda.jit
def pitched_copy(src, pitch, out):
    lane = cuda.threadIdx.x
    sh = cuda.shared.array(1024, np.uint32)
    cp_async16(sh, pitch * lane, src, 8 * lane, 16)
    cp_async_commit()
    cp_async_wait(0)
    for i in range(4):
        out[4 * lane + i] = sh[pitch // 4 * lane + i]


@SIMULATOR_ONLY
@pytest.mark.parametrize("pitch,conflicts", [(16, 0), (128, 4 * 7)], ids=["consecutive", "pitch-128"])
def test_cp_async_bank_conflicts(pitch, conflicts):
    """Consecutive chunks: each quarter warp's 128 bytes cover the 32 banks once; 128 bytes apart,
    its 8 chunks fall in the same 4 banks: 7 conflicts for each of 4 phases."""
    src = np.arange(256, dtype=np.uint16)
    out = np.zeros(128, np.uint32)
    reset_bank_counts()
    pitched_copy[1, 32](src, pitch, out)
    assert bank_counts()[CP_ASYNC_16.name] == (1, conflicts)
    np.testing.assert_array_equal(out, src.view(np.uint32))
