"""What every FlashAttention call does: check its tensors, turn its arguments into a spec's constants,
compile that spec once per constants and backend, and run its torch op."""

from __future__ import annotations

from typing import Any

import torch

import attncomp as ac
from attncomp.flash_attn.specs import SPECS
from attncomp.torch.traced_ops import TracedOps, trace_constant

#: the compiled spec's torch op of each "spec/backend/constants", by the name :func:`op_key` gives
OPS = TracedOps()


def op_key(spec: str, backend: str, deterministic: bool, constants: tuple[tuple[str, Any], ...]) -> str:
    """Compile ``spec`` (a name in ``SPECS``) with ``constants`` on ``backend`` once; give the name of its
    torch op in ``OPS``.  Under ``torch.compile`` it runs at trace time (``assume_constant_result``)."""
    key = f"{spec}/{backend}/{deterministic}/{constants}"
    compile_options = {"deterministic": True} if deterministic else {}
    return OPS.name(
        key, lambda: ac.compile(SPECS[spec], backend=backend, **compile_options, **dict(constants)).to_torch()
    )


#: ``op_key`` as torch.compile sees it: a constant of the trace
constant_op_key = torch.compiler.assume_constant_result(op_key)


def window(where: str, window_size: Any) -> tuple[int, int]:
    """``window_size`` as (left, right), each -1 (no bound) or a count of keys."""
    try:
        left, right = (int(trace_constant(w)) for w in window_size)
    except (TypeError, ValueError) as error:
        raise ValueError(
            f"{where}: window_size must be two integers (left, right), -1 for no bound; got {window_size!r}"
        ) from error
    if left < -1 or right < -1:
        raise ValueError(f"{where}: window_size: each side is -1 (no bound) or a count of keys; got {window_size!r}")
    return left, right


def check_heads(where: str, q: Any, k: Any, v: Any, dims: int) -> None:
    """Refuse, naming the argument, tensors of another rank, heads that do not group, head sizes that differ."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != dims:
            shape = "[B, T, H, D]" if dims == 4 else "[total, H, D]"
            got = f"{x.dim()} dimensions" if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{where}: {name} must be a tensor {shape}; got {got}")
    heads, kv_heads = q.shape[-2], k.shape[-2]
    if v.shape[-2] != kv_heads or kv_heads == 0 or heads % kv_heads:
        raise ValueError(
            f"{where}: k and v must have the same number of heads, dividing q's {heads}; got {kv_heads} and "
            f"{v.shape[-2]}"
        )
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"{where}: q and k must have the same head size; got {q.shape[-1]} and {k.shape[-1]}")


def check_table(where: str, block_table: Any, batch: int, device: Any) -> None:
    """Refuse, by name, a page table that is not int32 ``[batch, pages a sequence]`` on ``device``."""
    if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2 or block_table.shape[0] != batch:
        raise ValueError(
            f"{where}: block_table must be an int32 tensor [{batch}, pages a sequence]; got {block_table!r}"
        )
    if block_table.dtype != torch.int32 or block_table.device != device:
        raise TypeError(
            f"{where}: block_table must be int32 on {device}; got {block_table.dtype} on {block_table.device}"
        )


def used_table(block_table: torch.Tensor, lengths: torch.Tensor, page_size: int) -> torch.Tensor:
    """``block_table`` with the entries past each sequence's ``lengths`` (whatever they hold, even out of
    the pool's range) naming page 0: rows the spec masks, never read for a result."""
    used = torch.arange(block_table.shape[1], device=block_table.device) * page_size < lengths.to(torch.int64)[:, None]
    return torch.where(used, block_table, 0).to(torch.int32)


def table_rows(pages: torch.Tensor, block_table: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Each sequence's pages in its table's order as rows ``[batch, pages a sequence * page_size, ...]``
    (a copy of the pages read, which torch differentiates; :func:`used_table`'s entries)."""
    return pages[used_table(block_table, lengths, pages.shape[1]).to(torch.int64)].flatten(1, 2)


def paged_keys(
    k_pages: torch.Tensor, v_pages: torch.Tensor, block_table: torch.Tensor, lengths: torch.Tensor, q: torch.Tensor
) -> tuple[list[torch.Tensor], bool]:
    """A paged call's keys and values and whether they are read in place: the pages and the table
    (:func:`used_table`) for the kernels to read through it, or, where autograd records the call (a
    gradient of ``q`` or the pages), each sequence's pages as rows ``[batch, capacity, KV, D]``
    (:func:`table_rows`), which torch differentiates (``ac.page_view`` has no gradient)."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k_pages, v_pages)):
        return [table_rows(pages, block_table, lengths) for pages in (k_pages, v_pages)], False
    return [k_pages, v_pages, used_table(block_table, lengths, k_pages.shape[1])], True


def alibi_rows(where: str, alibi_slopes: Any, q: Any, batch: int) -> torch.Tensor:
    """The ALiBi slopes as ``[A, H]`` float32 (``A`` 1 or the batch); none: one row of zeros, unread."""
    heads = q.shape[-2]
    if alibi_slopes is None:
        return torch.zeros(1, heads, dtype=torch.float32, device=q.device)
    slopes = alibi_slopes if alibi_slopes.dim() == 2 else alibi_slopes[None]
    if slopes.dim() != 2 or slopes.shape[1] != heads or slopes.shape[0] not in (1, batch):
        raise ValueError(
            f"{where}: alibi_slopes must be ({heads},) or ({batch}, {heads}); got {tuple(alibi_slopes.shape)}"
        )
    if slopes.dtype != torch.float32:
        raise TypeError(f"{where}: alibi_slopes must be float32, as FlashAttention takes them; got {slopes.dtype}")
    return slopes


def run(
    where: str,
    spec: Any,
    args: list[Any],
    *,
    dropout_p: float,
    softmax_scale: float | None,
    causal: bool,
    window_size: Any,
    softcap: float,
    alibi: bool,
    deterministic: bool,
    lse: bool,
    backend: str | None,
) -> Any:
    """Run ``spec`` on ``args`` (a seed appended) with the call's constants (``where``: the function's name)."""
    left, right = window(where, window_size)
    softmax_scale, dropout_p, softcap, causal = (trace_constant(x) for x in (softmax_scale, dropout_p, softcap, causal))
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"{where}: dropout_p must be in [0, 1); got {dropout_p}")
    if softcap < 0:
        raise ValueError(f"{where}: softcap must be >= 0 (0: none); got {softcap}")
    constants = {
        "scale": None if softmax_scale is None else float(softmax_scale),
        "causal": bool(causal),
        "left": left,
        "right": right,
        "softcap": float(softcap),
        "alibi": bool(alibi),
        "dropout": float(dropout_p) if dropout_p else 0.0,
        "lse": bool(lse),
    }
    constants = tuple((name, value) for name, value in constants.items() if value is not None)
    seed = (
        torch.randint(-(2**63), 2**63 - 1, (), dtype=torch.int64) if dropout_p else torch.zeros((), dtype=torch.int64)
    )
    backend = backend or ("cuda" if args[0].device.type == "cuda" else "cpu")
    op = OPS[constant_op_key(spec.name, backend, bool(trace_constant(deterministic)), constants)]
    return op(*args, seed)


def with_probabilities(out: Any, lse: Any) -> tuple[Any, Any, Any]:
    """``return_attn_probs``'s result: the output, the log-sum-exp (float32) and, as FlashAttention's
    ``S_dmask`` where nothing is dropped, an empty tensor."""
    return out, lse.float(), out.new_empty(0)


def refuse_probabilities(where: str, return_attn_probs: bool, dropout_p: float) -> None:
    if return_attn_probs and dropout_p:
        raise NotImplementedError(
            f"{where}: return_attn_probs with dropout_p > 0 asks for the dropped-out probabilities, a [B, H, T, S] "
            "matrix attncomp never forms; the log-sum-exp comes with dropout_p=0"
        )
