"""GPU benchmark: forward+backward on tensor cores (bf16, and float32) against PyTorch SDPA's.

    python -m benchmarks.tensor_core_training            # the rows of the training targets
    python -m benchmarks.tensor_core_training --quick    # smaller sizes, for a smoke run
    python -m benchmarks.tensor_core_training --compile-only   # one untimed step per row: fills the kernel cache

(also printed by ``python -m benchmarks.gpu --only training``).  Each row runs one training
step of the attention alone, ``attn(q, k, v).backward(d_out)`` through ``fn.to_torch()`` of a
generic spec (the call's dtype picks the kernels: bf16 products on ``mma.sync`` forward and
backward), alternately with the same step through SDPA, CUDA-event timed, and reports the
median of the per-pair ratios (below 1.0 attncomp is faster).  bf16 rows' peer is SDPA
restricted to its flash backend (FlashAttention-2; the deterministic row's too, whose own
backward adds dQ with atomics); the window row's is SDPA with a boolean
mask; the float32 rows' is SDPA's efficient backend (``precision=exact``: the scalar float32
backward; ``precision=tf32``: the backward's products on tf32 tensor cores).  SDPA's own choice is timed too, named.
TFLOP/s count the step's seven products, 14 B H D per visible (query, key) pair.  Before
timing, the query gradient is checked against SDPA's.  Without a GPU it says so and exits
with status 0.
"""

from __future__ import annotations

import sys

import attncomp as ac
from benchmarks import specs
from benchmarks.tensor_cores import Row, Timing, main_of, paired_ms, sdpa_choice, table, window_mask

#: the least memory traffic of a step, in [B, H, T, D] arrays: the forward reads q, k and v and writes
#: the output (4); the backward reads q, k, v, the output and its gradient and writes dq, dk and dv (8)
STEP_ARRAYS = 12


def rows(quick: bool) -> list[Row]:
    t8 = 1024 if quick else 8192
    bf16 = "bfloat16"
    return [
        Row(f"bf16 causal T=S={t8} D=64 H=16", bf16, specs.causal_any, 1, 16, t8, 64, True),
        # the backward's target case (as much work as one sequence of 16384)
        Row(f"bf16 causal T=S={t8} B=4 D=128 H=16", bf16, specs.causal_any, 4, 16, t8, 128, True),
        # ALiBi with the slopes' gradient, against SDPA flash without ALiBi (SDPA takes a bias only
        # as a dense mask, off its flash backend)
        Row(f"bf16 causal ALiBi T=S={t8} D=64 H=16", bf16, specs.causal_alibi_any, 1, 16, t8, 64, True, alibi=True),
        # deterministic: a key-major kernel and a query-major dQ pass on tensor cores, no atomics
        Row(
            f"bf16 causal deterministic T=S={t8} D=64 H=16",
            bf16,
            specs.causal_any,
            1,
            16,
            t8,
            64,
            True,
            deterministic=True,
        ),
        # attention dropout: the mask hashed in the kernels, against FlashAttention-2's Philox dropout
        Row(
            f"bf16 causal dropout 0.1 T=S={t8} D=64 H=16",
            bf16,
            specs.causal_dropout,
            1,
            16,
            t8,
            64,
            True,
            constants={"rate": 0.1},
            dropout=0.1,
        ),
        Row(
            f"bf16 causal window 256 T=S={t8} D=64 H=16",
            bf16,
            specs.causal_window_any,
            1,
            16,
            t8,
            64,
            True,
            256,
            {"window": 256},
        ),
        *(
            Row(
                f"f32 {precision} causal T=S={t8} D=64 H=16",
                "float32",
                specs.causal_any,
                1,
                16,
                t8,
                64,
                True,
                precision=precision,
                peer="efficient",
                tolerance=2e-2 if precision == "tf32" else 1e-3,
            )
            for precision in ("exact", "tf32")
        ),
    ]


def compiled(row: Row):
    """The row's attention as a torch function (``deterministic``: its backward without atomics)."""
    options = {"deterministic": True} if row.deterministic else {}
    return ac.compile(row.spec, backend="cuda", pipeline=row.pipeline(), **options, **row.constants).to_torch()


def run_row(torch, row: Row, repeats: int) -> str:
    return measure_row(torch, row, repeats).line()


def warm_row(torch, row: Row) -> None:
    """One training step through attncomp's op at the row's size, untimed: the forward and backward
    kernels compile (and are cached on disk)."""
    dtype = getattr(torch, row.dtype)
    shape = (row.b, row.h, row.t, row.d)
    q, k, v = (torch.randn(shape, device="cuda", dtype=dtype).requires_grad_() for _ in range(3))
    extra = [alibi_slopes(torch, row.h).to(dtype).requires_grad_()] if row.alibi else []
    extra += [torch.tensor(7)] if row.dropout else []  # a CPU scalar: passed by value
    attn = compiled(row)
    attn(q, k, v, *extra).backward(torch.randn(shape, device="cuda", dtype=dtype))
    torch.cuda.synchronize()


def measure_row(torch, row: Row, repeats: int) -> Timing:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dtype = getattr(torch, row.dtype)
    generator = torch.Generator(device="cuda").manual_seed(0)
    shape = (row.b, row.h, row.t, row.d)
    q, k, v = (torch.randn(shape, device="cuda", dtype=dtype, generator=generator).requires_grad_() for _ in range(3))
    d_out = torch.randn(shape, device="cuda", dtype=dtype, generator=generator)
    attn = compiled(row)
    mask = window_mask(torch, row)
    extra = []
    if row.alibi:  # the slopes' gradient taken; SDPA's reference adds the same bias as a dense mask
        slopes = alibi_slopes(torch, row.h).to(dtype).requires_grad_()
        extra, mask = [slopes], alibi_mask(torch, row, slopes.detach())
    seeds = torch.tensor(0)
    if row.dropout:  # a new seed each step: a CPU scalar, passed to the kernels by value
        extra = [seeds]

    def step(forward):
        def run():
            q.grad = k.grad = v.grad = None
            for x in extra:
                x.grad = None
            seeds.add_(1)
            forward().backward(d_out)
            return q.grad

        return run

    def sdpa(mask=mask, dropout=row.dropout):
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=row.causal and mask is None
        )

    def restricted(backend, mask=mask):
        def forward():
            with sdpa_kernel(backend):
                return sdpa(mask)

        return forward

    ours = step(lambda: attn(q, k, v, *extra))
    got = ours().float().clone()
    want = step(lambda: sdpa(dropout=0.0))().float()
    error = float((got - want).abs().max() / want.abs().max())
    if row.dropout:  # other masks than SDPA's: the gradient is finite and not the one without dropout
        if not bool(torch.isfinite(got).all()) or error < 1e-2:
            raise AssertionError(f"{row.name}: attncomp's query gradient with dropout is not finite or not dropped")
    elif error > row.tolerance:
        raise AssertionError(f"{row.name}: attncomp's query gradient differs from torch's by {error:.2e}")
    if row.alibi:
        peer, peer_name = step(restricted(SDPBackend.FLASH_ATTENTION, None)), "flash, no ALiBi"
    elif mask is not None:
        peer, peer_name = step(sdpa), "sdpa+mask"
    elif row.peer == "flash":
        peer, peer_name = step(restricted(SDPBackend.FLASH_ATTENTION)), "flash"
    else:
        peer, peer_name = step(restricted(SDPBackend.EFFICIENT_ATTENTION)), "efficient"
    mine, theirs, ratio = paired_ms(torch, ours, peer, repeats)
    _, default, default_ratio = paired_ms(torch, ours, step(sdpa), repeats)
    with torch.no_grad():
        choice = sdpa_choice(torch, q, k, v, row.causal, mask, row.dropout)
    flops, traffic = 3.5 * row.flops(), row.bytes(STEP_ARRAYS)
    return Timing(row, mine, peer_name, theirs, ratio, choice, default, default_ratio, flops, traffic)


def alibi_slopes(torch, heads: int):
    """ALiBi's slopes for ``heads`` heads (a power of two): ``2^(-8 (h + 1) / heads)``, on the GPU."""
    return torch.tensor([2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)], device="cuda")


def alibi_mask(torch, row: Row, slopes):
    """SDPA's float mask of a causal ALiBi row: ``slopes[h] (j - i)``, -inf past the diagonal, [H, T, T]."""
    i = torch.arange(row.t, device="cuda")[:, None]
    j = torch.arange(row.t, device="cuda")[None, :]
    bias = slopes[:, None, None] * (j - i).to(slopes.dtype)
    return bias.masked_fill(j > i, float("-inf"))


def training_rows(torch, quick: bool, repeats: int) -> list[str]:
    title = "forward+backward on tensor cores ({name}; peak {peak} TFLOP/s dense bf16)"
    return table(torch, title, rows(quick), run_row, repeats)


def main(argv: list[str] | None = None) -> int:
    return main_of("benchmarks.tensor_core_training", __doc__, training_rows, argv, rows, warm_row)


if __name__ == "__main__":
    sys.exit(main())
