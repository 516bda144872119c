"""The head axis of PyTorch-style attention arguments: ``[N, L, E]`` is one head of ``[N, H, L, E]``."""

from __future__ import annotations

from typing import Any


def with_head_axis(what: str, query: Any, key: Any, value: Any, enable_gqa: bool) -> tuple[Any, Any, Any, bool]:
    """``query``, ``key`` and ``value`` with a head axis (3 dims: one head), and whether they had none.

    A ``ValueError`` starting with ``what`` (the function's name) for other ranks, ranks that
    differ, or query and key heads that differ without ``enable_gqa``."""
    if query.dim() not in (3, 4) or key.dim() != query.dim() or value.dim() != query.dim():
        raise ValueError(
            f"{what}: query, key and value must all have 3 or 4 dimensions, got "
            f"{query.dim()}, {key.dim()} and {value.dim()}"
        )
    three = query.dim() == 3
    if three:  # [N, L, E]: one head
        query, key, value = query[:, None], key[:, None], value[:, None]
    if query.shape[1] != key.shape[1] and not enable_gqa:
        raise ValueError(
            f"{what}: query has {query.shape[1]} heads and key {key.shape[1]}: "
            "pass enable_gqa=True for grouped-query attention"
        )
    return query, key, value, three
