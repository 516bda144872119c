"""The specs of FlashAttention's calls: tensors as FlashAttention lays them out (``[B, T, H, D]``, the
heads after the positions), read in place through the DSL's transposes.

Each computes what FlashAttention defines for query ``i`` and key ``j`` of one sequence, with
``d = i + S - T - j`` (the query's distance to the key, queries aligned to the last key)::

    score = q @ k.mT * scale                       # k's heads repeated for each group (GQA, MQA)
    score = softcap * tanh(score / softcap)        # where softcap > 0
    score = score - slope[h] * |d|                 # ALiBi, where slopes are given
    visible: d >= 0 (causal), d <= left, d >= -right (a window side of -1: unbounded)
    out = dropout(softmax(score)) @ v              # and logsumexp(score), where asked

:func:`flash_attention` takes whole sequences (``S - T`` from the sizes); :func:`flash_attention_varlen`
packed ones (``q_seq[i]``, ``k_seq[j]``: each position's sequence, a query seeing its own sequence's
keys only; ``q_shift[i]``: its sequence's ``S - T`` plus where its keys start less where its queries
do); :func:`flash_attention_cache` a key/value cache of ``k_len[b]`` keys from ``k_start[b]`` (left
padding); :func:`flash_attention_paged` and :func:`flash_attention_varlen_paged` the same with the
keys and values in FlashAttention's pages (``[num_pages, page_size, KV, D]``), read in place through
a page table (``ac.page_view(..., slot=1)``). Mask-elimination classifies every tile from these
conditions (the captured positions through per-block minimums and maximums): no mask is built.
The constants are the call's: ``scale`` (None: ``D ** -0.5``, read from the sizes), ``causal``,
``left`` and ``right`` (the window, -1 for none), ``softcap`` (0.0 for none), ``alibi``,
``dropout`` (the rate) and ``lse`` (the log-sum-exp as a second result).
"""

# Dimension names such as ac.floating["B", "T"] are sizes, not forward references.
# ruff: noqa: F821

from typing import Any

import attncomp as ac


def _heads_first(*tensors: Any) -> list[Any]:
    """``[B, T, H, D]`` read as ``[B, H, T, D]`` (a transpose: nothing copied)."""
    return [x.transpose(0, 2, 1, 3) for x in tensors]


def _attend(
    q: Any,
    k: Any,
    v: Any,
    slopes: Any,
    seed: Any,
    distance: Any,
    shown: Any,
    *,
    scale: float | None,
    causal: bool,
    left: int,
    right: int,
    softcap: float,
    alibi: bool,
    dropout: float,
    lse: bool,
    batch: Any = None,
) -> Any:
    """The attention of queries ``[B, T, H, D]`` to keys and values ``[B, KV, S, D]`` (heads first);
    ``distance(b, i, j)`` is ``d`` (see the module), ``shown(b, i, j)`` what else hides a key (None:
    nothing), ``batch(b, i)`` the row of ``slopes``."""
    (qh,), kh, vh = _heads_first(q), k, v
    n_rep = qh.shape[1] // kh.shape[1]
    s = (qh @ ac.repeat_kv(kh, n_rep).mT) * (qh.shape[-1] ** -0.5 if scale is None else scale)
    if softcap:
        s = softcap * ac.tanh(s / softcap)
    b, h, i, j = ac.index(s)
    d = distance(b, i, j)
    if alibi:
        row = b if batch is None else batch(b, i)
        s = s - slopes[ac.minimum(row, slopes.shape[0] - 1), h] * ac.abs(d)
    visible = shown(b, i, j)
    for condition, on in ((d >= 0, causal), (d <= left, left >= 0), (d >= -right, right >= 0 and not causal)):
        if on:
            visible = condition if visible is None else visible & condition
    if visible is not None:
        s = ac.where(visible, s, -ac.inf)
    out = ac.dropout(ac.softmax(s, axis=-1), dropout, seed) @ ac.repeat_kv(vh, n_rep)
    out = out.transpose(0, 2, 1, 3)
    return (out, ac.logsumexp(s, axis=-1)) if lse else out


def _attend_cache(q: Any, k: Any, v: Any, slopes: Any, k_len: Any, k_start: Any, seed: Any, **constants: Any) -> Any:
    """The attention of a cache's row ``b`` (keys and values ``[B, KV, S, D]``), keys
    ``k_start[b] <= j < k_len[b]``."""
    t = q.shape[1]
    return _attend(
        q, k, v, slopes, seed, lambda b, i, j: i + k_len[b] - t - j,
        lambda b, i, j: (j < k_len[b]) & (j >= k_start[b]), **constants,
    )  # fmt: skip


def _attend_packed(
    q: Any, k: Any, v: Any, slopes: Any, q_seq: Any, k_seq: Any, q_shift: Any, seed: Any, **constants: Any
) -> Any:
    """The attention of packed sequences (keys and values ``[1, KV, S, D]``): a query sees the keys of
    its own sequence, ``d = i + q_shift[i] - j``."""
    return _attend(
        q, k, v, slopes, seed, lambda b, i, j: i + q_shift[i] - j, lambda b, i, j: q_seq[i] == k_seq[j],
        batch=lambda b, i: q_seq[i], **constants,
    )  # fmt: skip


@ac.spec
def flash_attention(
    q: ac.floating["B", "T", "H", "D"],
    k: ac.floating["B", "S", "KV", "D"],
    v: ac.floating["B", "S", "KV", "Dv"],
    slopes: ac.f32["A", "H"],
    seed: ac.i64,
    *,
    scale: float | None = None,
    causal: bool = False,
    left: int = -1,
    right: int = -1,
    softcap: float = 0.0,
    alibi: bool = False,
    dropout: float = 0.0,
    lse: bool = False,
):
    """``flash_attn_func``: whole sequences, ``S - T`` from the sizes; ``A`` 1 or ``B``."""
    shift = k.shape[1] - q.shape[1]
    return _attend(
        q, *_heads_first(k, v), slopes, seed, lambda b, i, j: i + shift - j, lambda b, i, j: None,
        scale=scale, causal=causal, left=left, right=right, softcap=softcap, alibi=alibi, dropout=dropout, lse=lse,
    )  # fmt: skip


@ac.spec
def flash_attention_varlen(
    q: ac.floating[1, "T", "H", "D"],
    k: ac.floating[1, "S", "KV", "D"],
    v: ac.floating[1, "S", "KV", "Dv"],
    slopes: ac.f32["A", "H"],
    q_seq: ac.i32["T"],
    k_seq: ac.i32["S"],
    q_shift: ac.i32["T"],
    seed: ac.i64,
    *,
    scale: float | None = None,
    causal: bool = False,
    left: int = -1,
    right: int = -1,
    softcap: float = 0.0,
    alibi: bool = False,
    dropout: float = 0.0,
    lse: bool = False,
):
    """``flash_attn_varlen_func``: packed sequences, each position's sequence in ``q_seq`` / ``k_seq``."""
    return _attend_packed(
        q, *_heads_first(k, v), slopes, q_seq, k_seq, q_shift, seed,
        scale=scale, causal=causal, left=left, right=right, softcap=softcap, alibi=alibi, dropout=dropout, lse=lse,
    )  # fmt: skip


@ac.spec
def flash_attention_varlen_paged(
    q: ac.floating[1, "T", "H", "D"],
    k_pages: ac.floating["N", "P", "KV", "D"],
    v_pages: ac.floating["N", "P", "KV", "Dv"],
    table: ac.i32["E"],
    slopes: ac.f32["A", "H"],
    q_seq: ac.i32["T"],
    k_seq: ac.i32["S"],
    q_shift: ac.i32["T"],
    seed: ac.i64,
    *,
    scale: float | None = None,
    causal: bool = False,
    left: int = -1,
    right: int = -1,
    softcap: float = 0.0,
    alibi: bool = False,
    dropout: float = 0.0,
    lse: bool = False,
):
    """``flash_attn_varlen_func`` with a ``block_table``: the keys are the slots of the pages ``table``
    names, every sequence's row of the block table one after another (``[num_pages, page_size, KV, D]``,
    read in place), each row's sequence in ``k_seq``."""
    k, v = (ac.page_view(pages, table, table.shape[0] * k_pages.shape[1], slot=1) for pages in (k_pages, v_pages))
    return _attend_packed(
        q, k, v, slopes, q_seq, k_seq, q_shift, seed,
        scale=scale, causal=causal, left=left, right=right, softcap=softcap, alibi=alibi, dropout=dropout, lse=lse,
    )  # fmt: skip


@ac.spec
def flash_attention_cache(
    q: ac.floating["B", "T", "H", "D"],
    k: ac.floating["B", "S", "KV", "D"],
    v: ac.floating["B", "S", "KV", "Dv"],
    slopes: ac.f32["A", "H"],
    k_len: ac.i32["B"],
    k_start: ac.i32["B"],
    seed: ac.i64,
    *,
    scale: float | None = None,
    causal: bool = False,
    left: int = -1,
    right: int = -1,
    softcap: float = 0.0,
    alibi: bool = False,
    dropout: float = 0.0,
    lse: bool = False,
):
    """``flash_attn_with_kvcache``: a cache whose row ``b`` holds keys ``k_start[b] <= j < k_len[b]``."""
    return _attend_cache(
        q, *_heads_first(k, v), slopes, k_len, k_start, seed,
        scale=scale, causal=causal, left=left, right=right, softcap=softcap, alibi=alibi, dropout=dropout, lse=lse,
    )  # fmt: skip


@ac.spec
def flash_attention_paged(
    q: ac.floating["B", "T", "H", "D"],
    k_pages: ac.floating["N", "P", "KV", "D"],
    v_pages: ac.floating["N", "P", "KV", "Dv"],
    table: ac.i32["B", "E"],
    slopes: ac.f32["A", "H"],
    k_len: ac.i32["B"],
    k_start: ac.i32["B"],
    seed: ac.i64,
    *,
    scale: float | None = None,
    causal: bool = False,
    left: int = -1,
    right: int = -1,
    softcap: float = 0.0,
    alibi: bool = False,
    dropout: float = 0.0,
    lse: bool = False,
):
    """``flash_attn_with_kvcache`` with a ``block_table``: row ``b``'s keys are slots of the pages its
    ``table`` row names (``[num_pages, page_size, KV, D]``, read in place through the table)."""
    rows = table.shape[1] * k_pages.shape[1]
    k, v = (ac.page_view(pages, table, rows, slot=1) for pages in (k_pages, v_pages))
    return _attend_cache(
        q, k, v, slopes, k_len, k_start, seed,
        scale=scale, causal=causal, left=left, right=right, softcap=softcap, alibi=alibi, dropout=dropout, lse=lse,
    )  # fmt: skip


#: the specs by name, for the op keys (which take only constants)
SPECS = {
    spec.name: spec
    for spec in (
        flash_attention,
        flash_attention_varlen,
        flash_attention_varlen_paged,
        flash_attention_cache,
        flash_attention_paged,
    )
}
