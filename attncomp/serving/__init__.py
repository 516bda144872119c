"""Serving many sequences: a paged key/value cache (docs/api.md section 7)."""

from attncomp.serving.decoder import PagedDecoder
from attncomp.serving.pool import PagePool, PoolExhausted

__all__ = ["PagePool", "PagedDecoder", "PoolExhausted"]
