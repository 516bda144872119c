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

import numpy as np

from attncomp.backends.lse_merge import merge_partials
from attncomp.compilation import Compilation
from attncomp.ir.parser import parse_ir


@dataclass(frozen=True)
class PartRef:
    """One compiled part: the spec's input IR text, the backend and the pipeline that cuts the part."""

    text: str
    backend: str
    pipeline: str
    name: str


_BUILT: dict[PartRef, Compilation] = {}
#: how many times this process built each part (a test reads it on every worker)
BUILDS: Counter = Counter()


def register(ref: PartRef, fn: Compilation) -> None:
    """Keep ``fn``, already built by this process, as the part ``ref`` names."""
    _BUILT.setdefault(ref, fn)


def compiled(ref: PartRef) -> Compilation:
    fn = _BUILT.get(ref)
    if fn is None:
        fn = Compilation.build(parse_ir(ref.text), ref.backend, ref.pipeline, ref.name)
        _BUILT[ref] = fn
        BUILDS[ref.pipeline] += 1
    return fn


def builds() -> dict[str, int]:
    """Parts built by this process, by pipeline."""
    return dict(BUILDS)


def run_part(ref: PartRef, sizes: tuple[tuple[str, int], ...], *arrays: np.ndarray) -> tuple[np.ndarray, ...]:
    """Run one part on one chunk; ``sizes`` binds the offsets (and whole sizes) no argument carries."""
    fn = compiled(ref)
    return tuple(np.asarray(out) for out in fn.run(list(arrays), dict(sizes)))


def pick(results: tuple[np.ndarray, ...], index: int) -> np.ndarray:
    return results[index]


def no_keys(out_shape: tuple[int, ...], dtypes: tuple[str, ...]) -> tuple[np.ndarray, ...]:
    """The partial result of queries that no key chunk reaches, in the part's result types
    ``dtypes``: zeros and an LSE of -inf (and, a third, a max score of -inf)."""
    rows = [np.full(out_shape[:-1], -np.inf, dtype=dtype) for dtype in dtypes[1:]]
    return (np.zeros(out_shape, dtype=dtypes[0]), *rows)


#: a merge task: finished (output, LSE[, max]) partials combined by their log-sum-exp
merge = merge_partials


def merge_sums(*partials: tuple[np.ndarray, ...]) -> tuple[np.ndarray, ...]:
    """A merge task of unnormalised partials (sigmoid attention's): their outputs add up."""
    return merge_partials(*partials, normalized=False)
