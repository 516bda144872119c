"""What a chunked run's tasks call, on whichever process runs them.

Every function here is importable by name, so a Dask worker unpickles a task
as a reference to it.  A part of the spec (:class:`PartRef`: its input IR,
backend and pipeline) is built once per process and kept: on a cluster each
worker process compiles a kernel once (and Numba's disk cache, shared by the
processes of one machine, usually makes that a load), not once per task.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from attncomp.api import CompiledFunction


@dataclass(frozen=True)
class PartRef:
    """One compiled part: the spec's input IR text, the backend and the pipeline that cuts the part."""

    text: str
    backend: str
    pipeline: str
    name: str


_BUILT: dict[PartRef, CompiledFunction] = {}
#: how many times this process built each part (a test reads it on every worker)
BUILDS: Counter = Counter()


def register(ref: PartRef, fn: CompiledFunction) -> None:
    """Keep ``fn``, already built by this process, as the part ``ref`` names."""
    _BUILT.setdefault(ref, fn)


def compiled(ref: PartRef) -> CompiledFunction:
    fn = _BUILT.get(ref)
    if fn is None:
        from attncomp.api import CompiledFunction, parse_ir

        fn = CompiledFunction(parse_ir(ref.text), ref.backend, ref.pipeline, ref.name)
        _BUILT[ref] = fn
        BUILDS[ref.pipeline] += 1
    return fn


def builds() -> dict[str, int]:
    """Parts built by this process, by pipeline."""
    return dict(BUILDS)


def run_part(ref: PartRef, sizes: tuple[tuple[str, int], ...], *arrays: np.ndarray) -> tuple[np.ndarray, ...]:
    """Run one part on one chunk; ``sizes`` binds the offsets (and whole sizes) no argument carries."""
    fn = compiled(ref)
    return tuple(np.asarray(out) for out in fn._run(list(arrays), dict(sizes)))


def pick(results: tuple[np.ndarray, ...], index: int) -> np.ndarray:
    return results[index]


def no_keys(out_shape: tuple[int, ...], dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """The partial result of queries that no key chunk reaches: zeros and an LSE of -inf."""
    return np.zeros(out_shape, dtype=dtype), np.full(out_shape[:-1], -np.inf, dtype=dtype)


def merge(*partials: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Combine partial (output, LSE) pairs over disjoint key sets into one, by their log-sum-exp.

    Each output is a softmax-weighted mean over its keys, and its LSE the log of
    the weights' sum, so the merged output weighs each by exp(lse - max lse).  In
    float64; rows no key reaches (every LSE -inf) stay zero with LSE -inf.
    """
    dtype = partials[0][0].dtype
    lses = np.stack([np.asarray(lse, dtype=np.float64) for _, lse in partials])
    top = lses.max(axis=0)
    safe = np.where(np.isneginf(top), 0.0, top)
    weights = np.exp(lses - safe)
    total = weights.sum(axis=0)
    out = sum(w[..., None] * np.asarray(o, dtype=np.float64) for w, (o, _) in zip(weights, partials))
    reached = total > 0
    out = out / np.where(reached, total, 1.0)[..., None]
    lse = np.where(reached, safe + np.log(np.where(reached, total, 1.0)), -np.inf)
    return out.astype(dtype), lse.astype(dtype)
