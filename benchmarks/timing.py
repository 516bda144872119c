"""Timing side by side and checking results, shared by the benchmarks."""

from __future__ import annotations

import time

import numpy as np


def paired(ours, theirs, repeats: int) -> tuple[float, float, float]:
    """Median times of ``ours`` and ``theirs`` called alternately, and the median of the per-pair ratios."""
    ours(), theirs()  # warm-up: compiles, faults pages in
    mine, peer, ratios = [], [], []
    for _ in range(repeats):
        start = time.perf_counter()
        ours()
        middle = time.perf_counter()
        theirs()
        end = time.perf_counter()
        mine.append(middle - start)
        peer.append(end - middle)
        ratios.append((middle - start) / (end - middle))
    return float(np.median(mine)), float(np.median(peer)), float(np.median(ratios))


def check(name: str, got: np.ndarray, want: np.ndarray) -> None:
    """Raise when attncomp's result and the peer's differ by more than float32 rounding of the cases."""
    error = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
    if error > 1e-3:
        raise AssertionError(f"{name}: attncomp differs from the peer by {error:.2e}")
