"""``attncomp.flash_attn`` against what a PyTorch user runs for the same call: SDPA on the same
``[B, T, H, D]`` tensors (transposed views), given the mask as data where SDPA has no argument for it.

    python -m benchmarks.flash_attn                 # the CPU rows (float32)
    python -m benchmarks.flash_attn --device cuda   # bf16 on a GPU
    python -m benchmarks.flash_attn --compile-only  # one untimed call of each row: fills the caches

Rows: a causal sliding window of 512 (``window_size=(511, 0)``), forward and forward + backward;
four packed causal sequences (``flash_attn_varlen_func``) against SDPA with the block-diagonal
causal mask; a decoding step of 8 rows against a cache of up to 2,048 keys
(``flash_attn_with_kvcache``) against SDPA with the rows' key-padding mask, and the same step with
the cache in shuffled pages of 256 (``block_table``) against SDPA on the rows gathered from the
pages (PyTorch has no paged attention). 8 heads of 64 (2 key/value heads). Calls alternate; each
row gives the median times and the median of the per-pair ratios (below 1.0 attncomp is faster).
"""

from __future__ import annotations

import sys
from collections.abc import Callable


def _sdpa(torch, q, k, v, mask):
    """SDPA on ``[B, T, H, D]`` tensors, its grouped heads repeated as SDPA's math path needs."""
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True).transpose(1, 2)


def flash_attn_rows(quick: bool, repeats: int, device: str = "cpu", timed: bool = True) -> list[str]:
    """The rows on ``device``: whole sequences, packed sequences, a decoding step (``timed`` False: each
    side called once and checked, nothing timed)."""
    try:
        import torch
    except ImportError:
        return ["  flash_attn: torch is absent, nothing to compare with"]
    import attncomp.flash_attn as fa
    from benchmarks.timing import paired

    if device == "cuda":
        from benchmarks.tensor_cores import paired_ms

        def pair(ours: Callable, theirs: Callable) -> tuple[float, float, float]:
            return paired_ms(torch, ours, theirs, repeats)
    else:

        def pair(ours: Callable, theirs: Callable) -> tuple[float, float, float]:
            mine, other, ratio = paired(ours, theirs, repeats)
            return mine * 1e3, other * 1e3, ratio

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    length, window = (512 if quick else 2048), 512
    g = torch.Generator(device=device).manual_seed(3)

    def randn(*shape):
        return torch.randn(*shape, device=device, dtype=dtype, generator=g)

    q, k, v = randn(1, length, 8, 64), randn(1, length, 2, 64), randn(1, length, 2, 64)
    d = torch.arange(length, device=device)[:, None] - torch.arange(length, device=device)[None]
    banded = (d >= 0) & (d < window)
    title = f"flash_attn, {dtype}, H=8, KV=2, D=64, T={length}, {device}"
    lines = [f"  {title:<62} {'attncomp':>10} {'sdpa':>10} {'ratio':>7}"]

    def row(name: str, ours: Callable, theirs: Callable, tolerance: float = 1e-3) -> None:
        got, want = ours(), theirs()
        if got is not None:
            error = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
            if error > (3e-2 if device == "cuda" else tolerance):
                raise AssertionError(f"flash_attn {name}: attncomp differs from SDPA by {error:.2e}")
        if not timed:
            lines.append(f"  {name}: called once")
            return
        mine, other, ratio = pair(ours, theirs)
        lines.append(f"  {name:<62} {mine:8.2f}ms {other:8.2f}ms {ratio:7.2f}")

    with torch.no_grad():
        row(
            f"causal window {window}, forward",
            lambda: fa.flash_attn_func(q, k, v, causal=True, window_size=(window - 1, 0)),
            lambda: _sdpa(torch, q, k, v, banded),
        )
    trained = [x.clone().requires_grad_() for x in (q, k, v)]
    d_out = torch.randn_like(q)

    def step(attend: Callable) -> Callable[[], None]:
        def run() -> None:
            for x in trained:
                x.grad = None
            attend(*trained).backward(d_out)

        return run

    row(
        f"causal window {window}, fwd+bwd",
        step(lambda *x: fa.flash_attn_func(*x, causal=True, window_size=(window - 1, 0))),
        step(lambda *x: _sdpa(torch, *x, banded)),
    )
    pieces = 4
    cu = torch.arange(0, length + 1, length // pieces, device=device, dtype=torch.int32)
    seq = torch.arange(length, device=device) // (length // pieces)
    packed = (seq[:, None] == seq[None]) & (d >= 0)
    with torch.no_grad():
        row(
            f"{pieces} packed causal sequences (varlen)",
            lambda: fa.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, length, length, causal=True)[None],
            lambda: _sdpa(torch, q, k, v, packed),
        )
        batch = 8
        cache = [randn(batch, length, 2, 64) for _ in range(2)]
        lengths = torch.linspace(length // 4, length, batch, device=device).to(torch.int32)
        shown = (torch.arange(length, device=device)[None] < lengths[:, None])[:, None, None, :]
        step_q = randn(batch, 1, 8, 64)
        row(
            f"decoding step, {batch} rows, cache up to {length} keys",
            lambda: fa.flash_attn_with_kvcache(step_q, *cache, cache_seqlens=lengths),
            lambda: _sdpa(torch, step_q, *cache, shown),
        )
        # the same rows in pages of 256 (FlashAttention's [num_pages, page_size, KV, D]), shuffled
        size = 256
        order = torch.randperm(batch * length // size, generator=torch.Generator().manual_seed(4)).to(device)
        table = order.reshape(batch, length // size).to(torch.int32)
        pages = [torch.empty_like(c.reshape(-1, size, 2, 64)) for c in cache]
        for page, c in zip(pages, cache):
            page[table.long()] = c.reshape(batch, length // size, size, 2, 64)
        row(
            f"decoding step, pages of {size} (sdpa: the rows gathered)",
            lambda: fa.flash_attn_with_kvcache(step_q, *pages, cache_seqlens=lengths, block_table=table),
            lambda: _sdpa(torch, step_q, *(p[table.long()].flatten(1, 2) for p in pages), shown),
        )
    return lines


def warm(device: str, quick: bool) -> str:
    """One untimed call of each of attncomp's rows at the rows' sizes: their kernels cached (the GPU
    check's compile phase)."""
    lines = flash_attn_rows(quick, 0, device, timed=False)
    return f"compiled: flash_attn, {len(lines) - 1} rows, {device}"


def main(argv: list[str] | None = None) -> int:
    from benchmarks import device_rows

    return device_rows.main(__doc__, flash_attn_rows, warm, argv)


if __name__ == "__main__":
    sys.exit(main())
