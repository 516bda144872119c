"""The fuzzer's paths: a case's spec run by what splits it, against its whole-sequence result.

A spec's whole-sequence result must come out the same when

- **chunked**: a run over Dask arrays cuts the queries and keys into chunks of random sizes
  (``chunk-pairs``; partial results merge by their log-sum-exp, each row's max by the larger);
- **decoder**: ``fn.decoder`` is fed the sequence in random steps (``kv-cache-reuse``);
- **paged**: ``fn.paged_decoder`` serves each batch entry as a sequence of its own in random
  steps over pages of a random size, a fork of the first sequence sharing its prompt's pages
  (a cascade: the shared prefix attended once, merged with each sharer's own keys).

The decoders attend keys up to each query's own position, so they run the case made causal
over one sequence: ``j <= i`` (or ``j <= i + S - T``, aligned to the last query, which reads
the lengths) joined to its mask, as many keys as queries, and no captured
tensor along the sequence (a bias ``[B, H, T, S]``, document ids).  Every path runs in the
backend given (the interpreter by default: the splitting is what is under test).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

import attncomp as ac
from attncomp.testing import worst_error

#: captured inputs a decoder's step reads whole (none along the sequence)
WHOLE = {"slopes", "two", "table", "lengths", "blocks"}


def _steps(rng: np.random.Generator, length: int) -> list[tuple[int, int]]:
    """``[0, length)`` cut at random into steps of one or more positions."""
    cuts = sorted(rng.choice(np.arange(1, length), size=min(length - 1, int(rng.integers(0, 4))), replace=False))
    bounds = [0, *(int(c) for c in cuts), length]
    return list(zip(bounds[:-1], bounds[1:]))


def _joined(steps: list[Any], count: int) -> list[np.ndarray]:
    """Each result's steps joined along its query axis (the output's second last, the rows' last)."""
    results = [s if isinstance(s, tuple | list) else (s,) for s in steps]
    return [
        np.concatenate([np.asarray(r[n], np.float64) for r in results], axis=-2 if n == 0 else -1) for n in range(count)
    ]


def _compare(what: str, got: list[np.ndarray], want: list[np.ndarray], bound: float) -> str | None:
    for n, (g, w) in enumerate(zip(got, want)):
        if np.shape(g) != np.shape(w):
            return f"{what}: result {n} has shape {np.shape(g)}, the whole sequence's {np.shape(w)}"
    error = worst_error(got, want)
    return None if error <= bound else f"{what}: relative error {error:.3e}"


def chunked(fn: ac.CompiledFunction, inputs: list[np.ndarray], want: list[np.ndarray], rng, bound: float):
    """The run over Dask arrays with random query and key chunks (None where dask is missing)."""
    try:
        import dask
        import dask.array as da
    except ImportError:
        return None
    q, k, v, *captured = inputs
    q_chunk, k_chunk = (int(rng.integers(1, n + 1)) for n in (q.shape[-2], k.shape[-2]))
    lazy = [
        da.from_array(x, chunks=(*x.shape[:-2], n, x.shape[-1])) for x, n in ((q, q_chunk), (k, k_chunk), (v, k_chunk))
    ]
    got = fn(*lazy, *captured)
    got = dask.compute(*(got if isinstance(got, tuple) else (got,)), scheduler="synchronous")
    return _compare(f"chunked, chunks of {q_chunk} queries and {k_chunk} keys", list(got), want, bound)


def decoder(fn: ac.CompiledFunction, inputs: list[np.ndarray], want: list[np.ndarray], rng, bound: float):
    """``fn.decoder`` fed the sequence in random steps."""
    q, k, v, *captured = inputs
    steps = _steps(rng, q.shape[-2])
    decoding = fn.decoder(max_len=q.shape[-2])
    got = [decoding(q[..., a:b, :], k[..., a:b, :], v[..., a:b, :], *captured) for a, b in steps]
    return _compare(f"decoder, steps {steps}", _joined(got, len(want)), want, bound)


def paged(fn: ac.CompiledFunction, inputs: list[np.ndarray], want: list[np.ndarray], rng, bound: float, names):
    """``fn.paged_decoder``: each batch entry a sequence fed in random steps, pages of a random size,
    and a fork of the first sequence's prompt that attends it in cascade with its own keys."""
    q, k, v, *captured = inputs
    length = q.shape[-2]
    page_size = int(rng.choice([1, 2, 3, 4, 8]))
    serving = fn.paged_decoder(page_size=page_size, num_pages=2 * q.shape[0] * (length // page_size + 2) + 4)
    serving.cascade_min = page_size

    def entry(b: int, a: int, stop: int, x=(q, k, v)) -> tuple[np.ndarray, ...]:
        whole = [c[b : b + 1] if name == "lengths" else c for c, name in zip(captured, names)]
        return (*(t[b : b + 1, ..., a:stop, :] for t in x), *whole)

    sequences = {serving.new(): b for b in range(q.shape[0])}
    steps = _steps(rng, length)
    got: dict[int, list[Any]] = {seq: [] for seq in sequences}
    fork = None
    for n, (a, stop) in enumerate(steps):
        batch = {seq: entry(b, a, stop) for seq, b in sequences.items()}
        if fork is not None:  # the fork brings the same tokens as the first sequence
            batch[fork] = entry(0, a, stop)
        ys = serving.step(batch)
        for seq in batch:
            got.setdefault(seq, []).append(ys[seq])
        if n == 0 and len(steps) > 1:  # shares every page of the first sequence's prompt
            fork = serving.fork(next(iter(sequences)))
            got[fork] = list(got[next(iter(sequences))])
    what = f"paged decoder, pages of {page_size}, steps {steps}"
    for seq, b in [*sequences.items(), *([(fork, 0)] if fork is not None else [])]:
        mine = [w[b : b + 1] for w in want]
        problem = _compare(f"{what}, sequence {seq}", _joined(got[seq], len(want)), mine, bound)
        if problem is not None:
            return problem
    return None


def run_paths(case: Any, load: Any, seed: int, backend: str = "interp", bound: float = 1e-5) -> str | None:
    """None when every path gives the whole-sequence result of ``case`` (a :class:`attncomp.fuzz.Case`;
    ``load(case)`` its spec); else what differed."""
    rng = np.random.default_rng(seed + 2)
    spec = load(case)
    inputs = case.inputs(seed)
    try:
        want = [np.asarray(x, np.float64) for x in _results(ac.interpret(spec, *inputs))]
    except IndexError:  # a gather out of range: the fuzzer checks every stage raises it
        return None
    fn = ac.compile(spec, backend=backend, pipeline=case.pipeline)
    problem = chunked(fn, inputs, want, rng, bound)
    if problem is not None or not set(case.captured) <= WHOLE:
        return problem
    # causal as written for one sequence, or aligned to the last query (reading both lengths)
    rows = str(rng.choice(["j <= i", "j <= i + s.shape[-1] - s.shape[-2]"]))
    causal = replace(case, mask=f"({rows}) & ({case.mask})" if case.mask else rows, sizes=dict(case.sizes))
    causal.sizes["S"] = causal.sizes["T"]
    spec = load(causal)
    inputs = causal.inputs(seed)
    try:
        want = [np.asarray(x, np.float64) for x in _results(ac.interpret(spec, *inputs))]
    except IndexError:
        return None
    fn = ac.compile(spec, backend=backend, pipeline=case.pipeline)
    problem = decoder(fn, inputs, want, rng, bound)
    if problem is None:
        problem = paged(fn, inputs, want, rng, bound, causal.captured)
    return None if problem is None else f"{problem} (the case made causal: mask {causal.mask!r}, S = T)"


def _results(result: Any) -> list[Any]:
    return list(result) if isinstance(result, tuple) else [result]
