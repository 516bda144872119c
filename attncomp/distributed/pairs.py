"""One chunk pair's part on torch tensors, and the log-sum-exp merge of partial results."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from attncomp.compilation import Compilation


def run_part(torch: Any, compiled: Compilation, tensors: Sequence[Any], sizes: dict[str, int]) -> list[Any]:
    """``compiled``'s results on ``tensors`` (where its program reads them), ``sizes`` binding the
    offsets and whole sizes no argument carries: CPU tensors as numpy views, device tensors in place
    on PyTorch's current stream (``attncomp/torch/tensors.py``)."""
    from attncomp.torch.tensors import run_tensors

    return run_tensors(torch, compiled, tensors, sizes)


def merge(torch: Any, acc: tuple[Any, ...] | None, part: tuple[Any, ...], normalized: bool = True) -> tuple[Any, ...]:
    """Two (output, LSE) partials over disjoint keys as one, in float32; rows no key reaches
    (both LSEs -inf) stay zero with LSE -inf.  Partials of three (with each row's max score)
    keep the larger max.  ``normalized=False``: unnormalised partials (sigmoid attention's), whose
    outputs add up."""
    out, lse = part[0].float(), part[1].float()
    tops = (part[2].float(),) if len(part) == 3 else ()
    if acc is None:
        return (out, lse, *tops)
    if tops:
        tops = (torch.maximum(acc[2], tops[0]),)
    top = torch.maximum(acc[1], lse)
    safe = torch.where(torch.isneginf(top), torch.zeros_like(top), top)
    w_acc, w_new = torch.exp(acc[1] - safe), torch.exp(lse - safe)
    total = w_acc + w_new
    reached = total > 0
    if normalized:
        merged = (w_acc[..., None] * acc[0] + w_new[..., None] * out) / torch.where(reached, total, 1.0)[..., None]
    else:
        merged = acc[0] + out
    merged_lse = torch.where(reached, safe + torch.log(torch.where(reached, total, 1.0)), float("-inf"))
    return (merged, merged_lse, *tops)
