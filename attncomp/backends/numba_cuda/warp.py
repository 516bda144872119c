"""Warp-level instructions for the tensor-core kernels: PTX on the GPU, an emulation in the simulator.

The fragments of ``mma.sync.aligned.m16n8k16`` (PTX ISA, "Matrix Fragments for mma.m16n8k16"),
for lane ``l`` of a warp, ``g = l // 4`` (its group) and ``t = l % 4`` (its place in the quad):

- A, 16 x 16, 16-bit elements, four 32-bit registers of two elements each (low half first):
  ``a0 = A[g, 2t:2t+2]``, ``a1 = A[g+8, 2t:2t+2]``, ``a2 = A[g, 2t+8:2t+10]``, ``a3 = A[g+8, 2t+8:2t+10]``;
- B, 16 x 8: ``b0 = B[2t:2t+2, g]``, ``b1 = B[2t+8:2t+10, g]``;
- C and D, 16 x 8 float32: ``c0, c1 = C[g, 2t], C[g, 2t+1]``, ``c2, c3 = C[g+8, 2t], C[g+8, 2t+1]``.

A lane therefore holds two rows of the product (``g`` and ``g + 8``), and a row's elements are
spread over the four lanes of a quad: ``quad_max`` and ``quad_sum`` reduce a value over them
(butterfly shuffles, lanes ``l ^ 1`` then ``l ^ 2``); ``shuffle_xor(x, mask)`` is the float32 ``x``
of lane ``l ^ mask`` (the backward trades with ``l ^ 4``, the lane of the neighbouring row
``g ^ 1``).  The C fragments of two neighbouring 8-column tiles are, element for element, the A
fragment of their 16 columns: the scores of ``Q K^T`` become the operand of ``P V`` without
leaving registers.

The fragments of ``mma.sync.aligned.m16n8k8`` with tf32 elements (one element a register):
``a0 = A[g, t]``, ``a1 = A[g+8, t]``, ``a2 = A[g, t+4]``, ``a3 = A[g+8, t+4]``; ``b0 = B[t, g]``,
``b1 = B[t+4, g]``; C and D as above.  The C fragment's columns (``2t``, ``2t+1``) are not the
A fragment's (``t``, ``t+4``), but a product sums over its ``k``: the scores' columns ``2t`` and
``2t+1`` are fed as ``k = t`` and ``t + 4``, and the value rows are read in the same order.

- ``mma_f16``, ``mma_bf16``, ``mma_tf32``: ``D = A B + C`` with float32 accumulation.
- ``tf32_round(x)``: a float32 rounded to tf32 (10 fraction bits, to nearest, ties away from
  zero, as ``cvt.rna.tf32.f32``), as float32 bits; ``tf32_rest(x, big)``: what ``big`` missed of
  ``x``, rounded the same way.  ``big + rest`` carries 22 of float32's 24 bits: three products
  (``big big + big rest + rest big``) give a float32-accurate product on tensor cores (3xTF32).
- ``f32_bits(x)``, ``bits_f32(bits)``: a float32's bits and back (no conversion).
- ``pack_f16x2(lo, hi)``, ``pack_bf16x2(lo, hi)``: two float32 rounded to nearest even into a register.
- ``pack_halves(lo, hi)``: two float16 values' bits into a register.
- ``pack_bits(lo, hi)``: two 16-bit patterns (bf16 kept as uint16 or int16) into a register.
- ``widen_bf16(bits)``: the float32 of a bf16's 16-bit pattern (no rounding: bf16 is float32's top half).
- ``round_bf16(x)``: the 16-bit pattern of a float32 rounded to bf16 (to nearest even; NaN stays NaN,
  quieted; past bf16's range, infinity), by integer arithmetic on ``f32_bits``: the same code on the
  GPU and in the simulator, where ``cvt.rn.bf16.f32`` would need an emulation.
- ``exp2_approx(x)``: ``ex2.approx``, the softmax's exponential (``exp(x) = 2^(x log2 e)``).

On the GPU these are ``warp_ptx.py``'s inline PTX; under Numba's CUDA simulator
(``NUMBA_ENABLE_CUDASIM=1``) ``warp_sim.py``'s emulation with the same layout.
"""

from __future__ import annotations

from numba import cuda

if getattr(cuda.config, "ENABLE_CUDASIM", 0):
    from attncomp.backends.numba_cuda.warp_sim import (
        bits_f32,
        exp2_approx,
        f32_bits,
        mma_bf16,
        mma_f16,
        mma_tf32,
        pack_bf16x2,
        pack_bits,
        pack_f16x2,
        pack_halves,
        quad_max,
        quad_sum,
        round_bf16,
        shuffle_xor,
        tf32_rest,
        tf32_round,
        widen_bf16,
    )
else:
    from attncomp.backends.numba_cuda.warp_ptx import (
        bits_f32,
        exp2_approx,
        f32_bits,
        mma_bf16,
        mma_f16,
        mma_tf32,
        pack_bf16x2,
        pack_bits,
        pack_f16x2,
        pack_halves,
        round_bf16,
        shuffle_xor,
        tf32_rest,
        tf32_round,
        widen_bf16,
    )

    @cuda.jit(device=True, inline="always")
    def quad_max(x):
        x = max(x, shuffle_xor(x, 1))
        return max(x, shuffle_xor(x, 2))

    @cuda.jit(device=True, inline="always")
    def quad_sum(x):
        x = x + shuffle_xor(x, 1)
        return x + shuffle_xor(x, 2)


__all__ = [
    "bits_f32",
    "exp2_approx",
    "f32_bits",
    "mma_bf16",
    "mma_f16",
    "mma_tf32",
    "pack_bf16x2",
    "pack_bits",
    "pack_f16x2",
    "pack_halves",
    "quad_max",
    "quad_sum",
    "round_bf16",
    "shuffle_xor",
    "tf32_rest",
    "tf32_round",
    "widen_bf16",
]

#: the import line of a generated kernel
IMPORT = f"from attncomp.backends.numba_cuda.warp import {', '.join(__all__)}"
