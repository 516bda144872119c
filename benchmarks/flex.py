"""``attncomp.flex.flex_attention`` against PyTorch's FlexAttention, the same functions.

    python -m benchmarks.flex                    # the CPU rows (float32)
    python -m benchmarks.flex --device cuda      # the GPU rows (bf16), also a table of the GPU check
    python -m benchmarks.flex --compile-only --device cuda   # one untimed call of each: fills the caches

The case: four causal documents with ALiBi, ``doc[q_idx] == doc[kv_idx]`` and
``slopes[h] * (kv_idx - q_idx)`` read from captured tensors, 8 heads of 64 (16 of 64 on a GPU);
and a block mask of lists (``BlockMask.from_kv_blocks``: 15% of the blocks and the diagonal's).
The peer is ``torch.compile(flex_attention)`` on the same device; on the CPU, where PyTorch's
FlexAttention has no backward, the forward + backward's peer is SDPA given the same attention as a
dense float mask. Calls alternate; each row gives the median times and the median of the per-pair
ratios (below 1.0 attncomp is faster).
"""

from __future__ import annotations

import sys
from collections.abc import Callable


def case(torch, device: str, quick: bool):
    """(q, k, v, mask_mod, score_mod, length) of the benchmark's case on ``device``."""
    cuda = device == "cuda"
    length = (1024 if cuda else 512) if quick else (8192 if cuda else 2048)
    heads, dtype = (16, torch.bfloat16) if cuda else (8, torch.float32)
    generator = torch.Generator(device=device).manual_seed(7)
    q, k, v = (torch.randn(1, heads, length, 64, device=device, dtype=dtype, generator=generator) for _ in range(3))
    doc = torch.arange(length, device=device) // (length // 4)
    slopes = torch.tensor([2.0 ** (-8 * (n + 1) / heads) for n in range(heads)], device=device)

    def documents(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    return q, k, v, documents, alibi, length


def listed_mask(torch, flex, heads: int, length: int, device: str):
    """PyTorch's block mask of lists (``from_kv_blocks``, no ``mask_mod``): per head, 15% of the
    blocks of 128 drawn at random and the diagonal's, each shown whole."""
    blocks = length // 128
    generator = torch.Generator().manual_seed(11)
    chosen = torch.rand(1, heads, blocks, blocks, generator=generator) < 0.15
    chosen |= torch.eye(blocks, dtype=torch.bool)
    count = chosen.sum(-1).to(torch.int32)
    order = torch.argsort((~chosen).to(torch.int8), dim=-1, stable=True).to(torch.int32)  # chosen ones first
    lists = [x.to(device) for x in (count, order)]
    return flex.BlockMask.from_kv_blocks(*lists, BLOCK_SIZE=128, seq_lengths=(length, length))


def step(tensors: list, d_out, attend: Callable) -> Callable[[], None]:
    """A forward and backward of ``attend`` on ``tensors`` (which need their gradients)."""

    def run() -> None:
        for x in tensors:
            x.grad = None
        attend(*tensors).backward(d_out)

    return run


def flex_rows(quick: bool, repeats: int, device: str = "cpu") -> list[str]:
    """The rows on ``device``: forward, then forward + backward, each against its peer."""
    try:
        import torch
        from torch.nn.attention import flex_attention as flex
    except ImportError:
        return ["  flex: torch (with FlexAttention) is absent, nothing to compare with"]
    from attncomp.flex import create_block_mask, flex_attention
    from benchmarks.timing import paired

    if device == "cuda":
        from benchmarks.tensor_cores import paired_ms

        def timed(ours, theirs):
            return paired_ms(torch, ours, theirs, repeats)
    else:

        def timed(ours, theirs):
            mine, other, ratio = paired(ours, theirs, repeats)
            return mine * 1e3, other * 1e3, ratio

    q, k, v, documents, alibi, t = case(torch, device, quick)
    ours_mask = create_block_mask(documents, None, None, t, t)
    theirs_mask = flex.create_block_mask(documents, None, None, t, t, device=device)
    compiled = torch.compile(flex.flex_attention)
    title = f"flex_attention, 4 causal documents + ALiBi, {q.dtype}, H={q.shape[1]}, T=S={t}, {device}"
    lines = [f"  {title:<62} {'attncomp':>10} {'torch':>10} {'ratio':>7}"]
    with torch.no_grad():
        ours = lambda: flex_attention(q, k, v, alibi, ours_mask)  # noqa: E731
        theirs = lambda: compiled(q, k, v, alibi, theirs_mask)  # noqa: E731
        error = ((ours().float() - theirs().float()).abs().max() / theirs().float().abs().max()).item()
        if error > (3e-2 if device == "cuda" else 1e-3):
            raise AssertionError(f"flex forward: attncomp differs from FlexAttention by {error:.2e}")
        mine, other, ratio = timed(ours, theirs)
        lines.append(f"  {'forward, vs compiled FlexAttention':<62} {mine:8.2f}ms {other:8.2f}ms {ratio:7.2f}")
        listed = listed_mask(torch, flex, q.shape[1], t, device)
        ours = lambda: flex_attention(q, k, v, block_mask=listed)  # noqa: E731
        theirs = lambda: compiled(q, k, v, block_mask=listed)  # noqa: E731
        error = ((ours().float() - theirs().float()).abs().max() / theirs().float().abs().max()).item()
        if error > (3e-2 if device == "cuda" else 1e-3):
            raise AssertionError(f"flex forward, lists of blocks: attncomp differs from FlexAttention by {error:.2e}")
        mine, other, ratio = timed(ours, theirs)
        name = "forward, lists of blocks (15% + diagonal), vs compiled"
        lines.append(f"  {name:<62} {mine:8.2f}ms {other:8.2f}ms {ratio:7.2f}")
    trained = [x.clone().requires_grad_() for x in (q, k, v)]
    d_out = torch.randn_like(q)
    if device == "cuda":
        peer, name = step(trained, d_out, lambda *x: compiled(*x, alibi, theirs_mask)), "compiled FlexAttention"
    else:  # PyTorch's FlexAttention has no CPU backward: SDPA with the dense float mask
        i, j = torch.arange(t)[:, None], torch.arange(t)[None]
        slopes = torch.tensor([2.0 ** (-8 * (n + 1) / q.shape[1]) for n in range(q.shape[1])])
        dense = torch.where(documents(0, 0, i, j), slopes[:, None, None] * (j - i), -torch.inf)[None]
        sdpa = torch.nn.functional.scaled_dot_product_attention
        peer, name = step(trained, d_out, lambda *x: sdpa(*x, attn_mask=dense)), "SDPA with the dense float mask"
    mine, other, ratio = timed(step(trained, d_out, lambda *x: flex_attention(*x, alibi, ours_mask)), peer)
    lines.append(f"  {'fwd+bwd, vs ' + name:<62} {mine:8.2f}ms {other:8.2f}ms {ratio:7.2f}")
    return lines


def warm(device: str, quick: bool) -> str:
    """One untimed forward and backward of each side: attncomp's kernels and PyTorch's compiled ones
    cached (the GPU check's compile phase)."""
    import torch
    from torch.nn.attention import flex_attention as flex

    from attncomp.flex import create_block_mask, flex_attention

    q, k, v, documents, alibi, t = case(torch, device, quick)
    trained = [x.clone().requires_grad_() for x in (q, k, v)]
    flex_attention(*trained, alibi, create_block_mask(documents, None, None, t, t)).sum().backward()
    if device == "cuda":
        mask = flex.create_block_mask(documents, None, None, t, t, device=device)
        torch.compile(flex.flex_attention)(*trained, alibi, mask).sum().backward()
    return f"compiled: flex_attention, T=S={t}, {device}"


def main(argv: list[str] | None = None) -> int:
    from benchmarks import device_rows

    return device_rows.main(__doc__, flex_rows, warm, argv)


if __name__ == "__main__":
    sys.exit(main())
