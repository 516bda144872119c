"""Which way a forward kernel holds a tile's scores for BLAS's two products: by rows or by keys.

By rows, ``s = q_tile @ ksᵀ`` then ``acc += p @ vs``: the scores, the mask and the softmax run
along each row's keys, and a tensor the scores read at ``[.., i, j]`` (T5's position bias, a mask
given as data) is read a row's run of memory at a time.  By keys, the transposed ``st = ks @ q_tileᵀ``
then ``acc += stᵀ @ vs``: the softmax runs down the keys, vectorised over the rows.

Which is faster depends on the BLAS kernels.  On the 2-core AMD EPYC (alternated pairs, float32,
H = 8, D = 64, T = 2048), by rows against by keys: with OpenBLAS's Haswell kernels 0.94-0.96x with
64 x 128 tiles and 0.94x with 128 x 128 (causal, dense, four documents); with its SkylakeX kernels
0.89-0.90x with 128 x 128 tiles but 1.18x with 64 x 128: products of at most 100^3 multiply-adds take
those kernels' small-matrix path, which packs no operand, and there ``ks @ q_tileᵀ`` (no operand
transposed) ran at 256 GFLOP/s on one core against 162 for ``q_tile @ ksᵀ``.  T5's bias was 0.76x
(Haswell, 128 x 128) and 0.90x (SkylakeX, 64 x 128): scores read at ``[.., i, j]`` are held by rows
whatever the kernels.
"""

from __future__ import annotations

#: OpenBLAS's kernels (its names for them) with the small-matrix path for products of at most
#: 100^3 multiply-adds, where tiles of up to :data:`SMALL_TILE_ROWS` query rows are held by keys
SMALL_PRODUCT_KERNELS = frozenset({"SkylakeX", "Cooperlake", "SapphireRapids"})
SMALL_TILE_ROWS = 64


def by_keys(kernels: str | None, block_q: int, reads_along_keys: bool) -> bool:
    """Whether a tile of ``block_q`` query rows holds its scores by keys, where BLAS runs the kernels
    named ``kernels`` (``intrinsics.blas_kernels``) and the scores do or do not read a tensor along a
    row's keys."""
    return kernels in SMALL_PRODUCT_KERNELS and block_q <= SMALL_TILE_ROWS and not reads_along_keys
