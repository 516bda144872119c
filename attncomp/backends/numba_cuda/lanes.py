"""What the forward and backward kernels' plans share: lanes per item, and the limits of a thread block.

Both kernels give each item (a query row forward, a key backward) ``lanes``
consecutive threads; lane ``g`` keeps the features ``g, g + lanes, ...`` of
the item's rows in registers, at most ``max_slice`` of each.  Interleaving
makes the lanes of a warp read consecutive words of a shared-memory row.
"""

from __future__ import annotations

from attncomp.backends.tiles import LoweringError

WARP = 32
#: threads in a block, at most
MAX_THREADS = 1024
#: static shared memory a block may use (CUDA's limit without opting in is 48 KiB)
SHARED_BUDGET = 48 * 1024


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def quotient(x: str, n: int) -> str:
    """A kernel's ``x // n`` for a non-negative ``x``: a shift where ``n`` is a power of two."""
    return f"({x} >> {n.bit_length() - 1})" if n & (n - 1) == 0 else f"({x} // {n})"


def remainder(x: str, n: int) -> str:
    """A kernel's ``x % n`` for a non-negative ``x``: a mask where ``n`` is a power of two."""
    return f"({x} & {n - 1})" if n & (n - 1) == 0 else f"({x} % {n})"


def choose_lanes(head_dim: int, value_dim: int, max_slice: int, items: int, lanes: int | None, what: str) -> int:
    """Threads per item: the fewest that keep each register slice within ``max_slice`` and give a
    block of ``items`` items at least a warp; ``lanes`` (tests: every layout at small sizes) overrides.
    ``what`` names the item in the error ("lanes per row")."""
    if lanes is None:
        lanes = 1
        while lanes < WARP and (ceil_div(head_dim, lanes) > max_slice or ceil_div(value_dim, lanes) > max_slice):
            lanes *= 2
        while lanes < WARP and items * lanes < WARP:  # at least a warp per thread block
            lanes *= 2
    if lanes < 1 or WARP % lanes:
        raise LoweringError(f"{what} must divide {WARP}, got {lanes}")
    return lanes
