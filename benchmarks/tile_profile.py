"""Where a dense forward's time goes on the CPU, next to the machine's sgemm peak.

    python -m benchmarks.tile_profile

One thread, float32, H = 8, T = S = 1024, D = 64, blocks of 64 queries by 64 keys.
The CPU kernel's tile loop, its scores held by keys (``score_layout``: OpenBLAS's small-matrix
kernels), is rebuilt here from the same shared code (the ``gemm``
intrinsic, ``tile_math.softmax_by_keys``) with parts switched off: the two
products (BLAS), the scores pass (scale and row max), the online-softmax step
(lazy rescale, exp2, row sums).  Each variant, and the compiled kernel itself on
one thread, is alternated with torch SDPA on one thread; printed are the medians
and the median per-pair ratio.  Then OpenBLAS's single-threaded sgemm at 64^3
(one tile's product) and at 2048^3 (the peak).

What it shows on the project's 2-core Xeon (AVX-512): the two products run at
about 96% of the single-threaded sgemm peak and take 80% of the tile loop's time;
the loop (and the compiled kernel) reach 78% of the peak, as torch does.  With
BLAS products the ceiling is 0.81x torch's time, with no passes at all; 0.9x needs
the passes at half their cost, which a product whose epilogue computes the scores
in registers (a fused micro-kernel: a BLAS call does not allow it) would give.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("NUMBA_NUM_THREADS", "1")

import time  # noqa: E402

import numpy as np  # noqa: E402
from numba import njit  # noqa: E402

from attncomp.backends.numba_cpu.intrinsics import gemm, maximum_f32, prefer_wide_vectors  # noqa: E402
from attncomp.backends.numba_cpu.tile_math import FASTMATH, softmax_by_keys  # noqa: E402

SCORES, SOFTMAX, PRODUCT_1, PRODUCT_2 = 1, 2, 4, 8
VARIANTS = {
    "the tile loop": SCORES | SOFTMAX | PRODUCT_1 | PRODUCT_2,
    "without the scores pass": SOFTMAX | PRODUCT_1 | PRODUCT_2,
    "without the softmax step": SCORES | PRODUCT_1 | PRODUCT_2,
    "the two products only": PRODUCT_1 | PRODUCT_2,
    "the two passes only": SCORES | SOFTMAX,
}


@njit(fastmath=FASTMATH, nogil=True)
def tile_loop(q, k, v, out, parts):
    """The forward's tile loop for ``q, k, v`` of ``[H, T, D]``, with ``parts`` switched on."""
    prefer_wide_vectors()
    bq, bk = 64, 64
    heads, rows, d = q.shape
    keys = k.shape[1]
    qt_t = np.empty((d, bq), np.float32)
    st = np.zeros((bk, bq), np.float32)
    m = np.empty((1, bq), np.float32)
    total = np.empty((1, bq), np.float32)
    acc = np.empty((1, bq, d), np.float32)
    mx = np.zeros(bq, np.float32)
    m_safe = np.empty(bq, np.float32)
    row_sum = np.empty(bq, np.float32)
    scale = np.float32(1.4426950408889634 / np.sqrt(d))
    for h in range(heads):
        for qb in range(rows // bq):
            i0 = qb * bq
            for r in range(bq):
                for e in range(d):
                    qt_t[e, r] = q[h, i0 + r, e]
            m[:] = -np.inf
            total[:] = 0.0
            acc[:] = 0.0
            for kb in range(keys // bk):
                ks = k[h, kb * bk : (kb + 1) * bk]
                vs = v[h, kb * bk : (kb + 1) * bk]
                if parts & PRODUCT_1:
                    gemm(0, 0, bk, bq, d, ks, qt_t, 0.0, st)
                if parts & SCORES:
                    for r in range(bq):
                        mx[r] = -np.inf
                    for c in range(bk):
                        for r in range(bq):
                            x = st[c, r] * scale
                            st[c, r] = x
                            mx[r] = maximum_f32(mx[r], x)
                if parts & SOFTMAX:
                    softmax_by_keys(st, bq, bk, m, total, acc, mx, m_safe, row_sum, 0)
                if parts & PRODUCT_2:
                    gemm(1, 0, bq, d, bk, st, vs, 1.0, acc[0])
            for r in range(bq):
                for e in range(d):
                    out[h, i0 + r, e] = acc[0, r, e] / (total[0, r] + np.float32(1.0))


def sgemm_rate(n: int) -> float:
    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    a @ a
    repeats = max(1, int(4e9 / (2 * n**3)))
    start = time.perf_counter()
    for _ in range(repeats):
        a @ a
    return 2 * n**3 * repeats / (time.perf_counter() - start) / 1e9


def main() -> None:
    import numba

    import attncomp as ac
    from benchmarks import peers, specs
    from benchmarks.timing import paired

    torch = peers.torch_or_none()
    if torch is None:
        raise SystemExit("benchmarks.tile_profile compares with torch: pip install 'attncomp[torch]'")
    torch.set_num_threads(1)
    numba.set_num_threads(1)
    heads, n, d = 8, 1024, 64
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((heads, n, d), dtype=np.float32) for _ in range(3))
    out = np.empty_like(q)
    tq, tk, tv = (torch.from_numpy(x[None]) for x in (q, k, v))
    fn = ac.compile(specs.dense, backend="cpu")
    flops = 4 * heads * n * n * d

    def theirs():
        return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv)

    calls = {name: (lambda parts=parts: tile_loop(q, k, v, out, parts)) for name, parts in VARIANTS.items()}
    calls["the compiled kernel (dense spec)"] = lambda: fn(q[None], k[None], v[None])
    print(f"dense T=S={n} H={heads} D={d}, float32, one thread; each row alternated with torch SDPA (one thread)")
    print(f"  {'':34s} {'ms':>7s} {'GFLOP/s':>8s} {'share':>6s} {'vs torch':>9s}")
    whole = None
    for name, call in calls.items():
        mine, peer, ratio = paired(call, theirs, 9)
        whole = mine if whole is None else whole
        print(f"  {name:34s} {mine * 1e3:7.2f} {flops / mine / 1e9:8.1f} {mine / whole:6.0%} {ratio:9.2f}")
    print(f"  {'torch SDPA':34s} {peer * 1e3:7.2f} {flops / peer / 1e9:8.1f}")
    small, peak = sgemm_rate(64), sgemm_rate(2048)
    print(f"  OpenBLAS sgemm, one thread: 64^3 {small:.0f} GFLOP/s, 2048^3 {peak:.0f} GFLOP/s (the peak)")


if __name__ == "__main__":
    main()
