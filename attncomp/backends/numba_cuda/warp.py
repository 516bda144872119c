"""Warp-level instructions for the tensor-core kernels: PTX on the GPU, an emulation in the simulator.

The fragments of ``mma.sync.aligned.m16n8k16`` (f16, bf16) and ``m16n8k8`` (tf32), which element of
A, B and C each lane's registers hold and how two 16-bit elements share a register, are the table
of ``mma/atoms.py`` (``M16N8K16``, ``M16N8K8_TF32``): the emulation and the kernel writers read
them there.  A lane holds two rows of the product (``g`` and ``g + 8``, ``g = lane // 4``), and a
row's elements are spread over the four lanes of a quad: ``quad_max`` and ``quad_sum`` reduce a
value over them (butterfly shuffles over ``ACCUMULATOR.row_lane_masks()``); ``shuffle_xor(x,
mask)`` is the float32 ``x`` of lane ``l ^ mask`` (the backward trades with the lane of the
neighbouring row, ``ACCUMULATOR.next_row_mask()``).  The accumulators of one product are the A
operand of the next without leaving registers, in the order ``MmaAtom.feed`` gives.

- ``mma_f16``, ``mma_bf16``, ``mma_tf32``: ``D = A B + C`` with float32 accumulation.
- ``tf32_round(x)``: a float32 rounded to tf32 (10 fraction bits, to nearest, ties away from
  zero, as ``cvt.rna.tf32.f32``), as float32 bits; ``tf32_rest(x, big)``: what ``big`` missed of
  ``x``, rounded the same way.  ``big + rest`` carries 22 of float32's 24 bits: three products
  (``big big + big rest + rest big``) give a float32-accurate product on tensor cores (3xTF32).
- ``f32_bits(x)``, ``bits_f32(bits)``: a float32's bits and back (no conversion).
- ``pack_f16x2(lo, hi)``, ``pack_bf16x2(lo, hi)``: two float32 rounded to nearest even into a register
  (``lo`` in the low half, the table's half 0).
- ``pack_halves(lo, hi)``: two float16 values' bits into a register.
- ``pack_bits(lo, hi)``: two 16-bit patterns (bf16 kept as uint16 or int16) into a register.
- ``widen_bf16(bits)``: the float32 of a bf16's 16-bit pattern (no rounding: bf16 is float32's top half).
- ``round_bf16(x)``: the 16-bit pattern of a float32 rounded to bf16 (to nearest even; NaN stays NaN,
  quieted; past bf16's range, infinity), by integer arithmetic on ``f32_bits``: the same code on the
  GPU and in the simulator, where ``cvt.rn.bf16.f32`` would need an emulation.
- ``exp2_approx(x)``: ``ex2.approx``, the softmax's exponential (``exp(x) = 2^(x log2 e)``).
- ``log2_approx(x)``: ``lg2.approx``, a score function's float32 logarithm (``log x = log2(x) ln 2``,
  ``device_math.fast_log``).
- ``rcp_approx(x)``: ``rcp.approx``, ``1 / x`` within one unit in the last place: a 16-bit output's
  ``1 / l`` (an IEEE division is some twenty instructions and a slow-path call).
- ``cp_async16(dst, dst_byte, src, src_elem, src_bytes)``: 16 bytes from element ``src_elem`` of a
  global array to byte ``dst_byte`` of a shared one, asynchronously (``cp.async.cg``, zero-filled past
  ``src_bytes``); ``cp_async_commit()`` closes this thread's group of copies and
  ``cp_async_wait(n)`` waits until at most ``n`` groups are in flight (``atoms.CP_ASYNC_16``).
- ``load_pair16(array, index)``, ``store_pair16(array, index, word)``: two neighbouring 16-bit
  elements of a dense array (``index`` even) as one 32-bit load or store, the first in the low half.
- ``red_add_f32(array, index, value)``: ``red.global.add``, an atomic add nothing waits for, at a
  flat element of a dense array (dQ's sums over key blocks, the backward's dK and dV).
- ``ldmatrix_x4(sh, byte)``, ``ldmatrix_x4_trans(sh, byte)``: four 8 x 8 matrices of 16-bit elements
  from shared memory, a lane giving one row's address, into four registers a lane
  (``atoms.LDMATRIX_X4``, ``LDMATRIX_X4_TRANS``): B fragments of ``m16n8k16``.

On the GPU these are ``mma/warp_ptx.py``'s inline PTX; under Numba's CUDA simulator
(``NUMBA_ENABLE_CUDASIM=1``) the emulation with the same layout of ``mma/warp_sim.py`` (products,
shuffles, bit conversions) and ``mma/warp_sim_copies.py`` (shared-memory copies).
"""

from __future__ import annotations

from numba import cuda

from attncomp.backends.numba_cuda.mma.atoms import ACCUMULATOR

SIMULATED = bool(getattr(cuda.config, "ENABLE_CUDASIM", 0))
#: the alignment of shared tiles that ``cp_async16`` writes and ``ldmatrix`` reads (16 bytes; a
#: uint32 array's own is 4); None in the simulator, whose shared arrays take none (numpy's
#: allocations are 16-byte aligned anyway)
COPY_ALIGNMENT = None if SIMULATED else 16

if SIMULATED:
    from attncomp.backends.numba_cuda.mma.warp_sim import (
        bits_f32,
        exp2_approx,
        f32_bits,
        log2_approx,
        mma_bf16,
        mma_f16,
        mma_tf32,
        pack_bf16x2,
        pack_bits,
        pack_f16x2,
        pack_halves,
        quad_max,
        quad_sum,
        rcp_approx,
        round_bf16,
        shuffle_xor,
        tf32_rest,
        tf32_round,
        widen_bf16,
    )
    from attncomp.backends.numba_cuda.mma.warp_sim_copies import (
        cp_async16,
        cp_async_commit,
        cp_async_wait,
        ldmatrix_x4,
        ldmatrix_x4_trans,
        load_pair16,
        red_add_f32,
        store_pair16,
    )
else:
    from attncomp.backends.numba_cuda.mma.warp_ptx import (
        bits_f32,
        cp_async16,
        cp_async_commit,
        cp_async_wait,
        exp2_approx,
        f32_bits,
        ldmatrix_x4,
        ldmatrix_x4_trans,
        load_pair16,
        log2_approx,
        mma_bf16,
        mma_f16,
        mma_tf32,
        pack_bf16x2,
        pack_bits,
        pack_f16x2,
        pack_halves,
        rcp_approx,
        red_add_f32,
        round_bf16,
        shuffle_xor,
        store_pair16,
        tf32_rest,
        tf32_round,
        widen_bf16,
    )

    #: the lanes that share an accumulator row: ``l ^ 1``, then ``l ^ 2``
    _QUAD_FIRST, _QUAD_SECOND = ACCUMULATOR.row_lane_masks()

    @cuda.jit(device=True, inline="always")
    def quad_max(x):
        x = max(x, shuffle_xor(x, _QUAD_FIRST))
        return max(x, shuffle_xor(x, _QUAD_SECOND))

    @cuda.jit(device=True, inline="always")
    def quad_sum(x):
        x = x + shuffle_xor(x, _QUAD_FIRST)
        return x + shuffle_xor(x, _QUAD_SECOND)


__all__ = [
    "COPY_ALIGNMENT",
    "bits_f32",
    "cp_async16",
    "cp_async_commit",
    "cp_async_wait",
    "exp2_approx",
    "f32_bits",
    "ldmatrix_x4",
    "ldmatrix_x4_trans",
    "load_pair16",
    "log2_approx",
    "mma_bf16",
    "mma_f16",
    "mma_tf32",
    "pack_bf16x2",
    "pack_bits",
    "pack_f16x2",
    "pack_halves",
    "quad_max",
    "quad_sum",
    "rcp_approx",
    "red_add_f32",
    "round_bf16",
    "shuffle_xor",
    "store_pair16",
    "tf32_rest",
    "tf32_round",
    "widen_bf16",
]

#: the import line of a generated kernel
IMPORT = f"from attncomp.backends.numba_cuda.warp import {', '.join(__all__)}"
