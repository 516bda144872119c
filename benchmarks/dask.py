"""Dask benchmark: causal attention on a LocalCluster against the plain call, side by side.

    python -m benchmarks.dask             # causal T = 65536, H = 8, D = 64, chunks of 8192
    python -m benchmarks.dask --quick     # T = 16384, chunks of 4096

The cluster is 2 single-threaded worker processes (Numba limited to one thread
each); the plain call is the same compiled function on numpy arrays with 2
threads.  The inputs are persisted on the cluster first, and the Dask time
includes gathering the result back.  The two are called alternately and the
ratio is the median of the per-pair ratios.  Then the task count against n^2,
each pair task's time and bytes (from the cluster's task stream), and the
scaling model of docs/dask.md ("A scaling model"), extrapolated from
those measurements to T = 1M on 8, 64 and 512 workers.
"""

from __future__ import annotations

import argparse
import ast
import math
import os

import numpy as np

os.environ.setdefault("NUMBA_NUM_THREADS", "2")

import attncomp as ac  # noqa: E402
from attncomp.chunked import PAIR  # noqa: E402
from benchmarks import results_file, specs  # noqa: E402
from benchmarks.timing import paired  # noqa: E402


def pair_seconds(stream: list[dict]) -> tuple[list[float], list[float]]:
    """Compute times of the pair tasks in a task stream: off the diagonal (whole pairs), and on it."""
    whole, diagonal = [], []
    for record in stream:
        key = record["key"]
        key = ast.literal_eval(key) if isinstance(key, str) and key.startswith("(") else key
        if not (isinstance(key, tuple) and str(key[0]).startswith(PAIR)):
            continue
        seconds = sum(s["stop"] - s["start"] for s in record["startstops"] if s["action"] == "compute")
        (diagonal if key[-1] == key[-2] else whole).append(seconds)
    return whole, diagonal


def model(per_pair: float, chunk: int, h: int, d: int, t: int, workers: int, bandwidth: float) -> dict[str, float]:
    """A causal run at length ``t`` on ``workers`` single-threaded workers, on paper.

    The n(n+1)/2 pair tasks are shared out as square blocks of the triangle,
    s x s pairs per worker with s = sqrt(pairs / workers) (what a scheduler
    placing tasks next to their inputs approaches): a worker reads s query
    chunks and s key and value chunks, and sends out s partial outputs for
    the merges.  A row's merge tree has depth ceil(log2 n); its top
    ceil(log2(n / s)) levels join partials from different workers.
    """
    n = math.ceil(t / chunk)
    pairs = n * (n + 1) // 2
    chunk_bytes = chunk * h * d * 4
    side = min(math.sqrt(pairs / workers), n)
    moved = (3 * side + side) * chunk_bytes
    return {
        "n": n,
        "pairs": pairs,
        "tasks": pairs + (pairs - n),  # pair tasks and the merges joining them
        "compute_s": pairs * per_pair / workers,
        "side": side,
        "moved_gb": moved / 1e9,
        "network_s": moved / bandwidth,
        "depth": math.ceil(math.log2(n)) if n > 1 else 0,
        "cross_depth": max(math.ceil(math.log2(n / side)), 0) if side < n else 0,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="T = 16384, chunks of 4096")
    parser.add_argument("--pairs", type=int, default=3, help="alternating pairs of calls timed")
    parser.add_argument("--bandwidth", type=float, default=1.25e9, help="bytes/s between workers, for the model")
    results_file.add_option(parser)
    args = parser.parse_args(argv)
    with results_file.recorded(args, "benchmarks.dask", argv):
        import dask.array as da
        from dask.distributed import Client, LocalCluster, get_task_stream, wait

        t, chunk = (16384, 4096) if args.quick else (65536, 8192)
        b, h, d = 1, 8, 64
        fn = ac.compile(specs.causal, backend="cpu")
        with (
            LocalCluster(
                n_workers=2,
                threads_per_worker=1,
                processes=True,
                dashboard_address=None,
                env={"NUMBA_NUM_THREADS": "1"},
            ) as cluster,
            Client(cluster) as client,
        ):
            # made on the workers, so the graph does not carry the data; the plain call gets the same numbers
            rng = da.random.default_rng(0)
            lazy = [
                client.persist(rng.standard_normal((b, h, t, d), chunks=(1, h, chunk, d), dtype=np.float32))
                for _ in range(3)
            ]
            wait(lazy)
            q, k, v = (x.compute() for x in lazy)
            out = fn(*lazy)
            n = -(-t // chunk)
            tasks = sum(1 for key in dict(out.__dask_graph__()) if isinstance(key, tuple) and key[0].startswith(PAIR))
            expected = fn(q, k, v)
            got = out.compute()
            error = float(np.max(np.abs(got - expected)) / np.max(np.abs(expected)))
            dask_s, plain_s, ratio = paired(lambda: out.compute(), lambda: fn(q, k, v), args.pairs)
            with get_task_stream(client) as stream:
                out.compute()
            whole, diagonal = pair_seconds(stream.data)

        per_pair = float(np.median(whole)) if whole else float(np.median(diagonal))
        chunk_mb = chunk * h * d * 4 / 1e6
        print(f"causal T = {t}, H = {h}, D = {d}, chunks of {chunk}: relative error {error:.1e}")
        print()
        print("| run | seconds | ratio to the plain call |")
        print("|---|---:|---:|")
        print(f"| plain call, numpy arrays, 2 threads | {plain_s:.2f} | 1.00 |")
        print(f"| dask, LocalCluster of 2 single-threaded processes | {dask_s:.2f} | {ratio:.2f} |")
        print()
        print(f"attention tasks: {tasks} = n(n+1)/2 for n = {n} chunks, against n^2 = {n * n}")
        print(
            f"pair task, one thread: {per_pair:.3f} s off the diagonal, "
            f"{float(np.median(diagonal)) if diagonal else float('nan'):.3f} s on it; "
            f"reads 3 chunks of {chunk_mb:.1f} MB, writes a partial output of {chunk_mb:.1f} MB"
        )
        print()
        big = 1 << 20
        print(f"model: T = {big}, chunks of {chunk}, {args.bandwidth / 1e9:.2f} GB/s between workers")
        print()
        print(
            "| workers | pair tasks | all tasks | compute per worker (s) | block side (chunks) "
            "| moved per worker (GB) | network (s) | merge depth (across workers) |"
        )
        print("|---:|---:|---:|---:|---:|---:|---:|---:|")
        for workers in (8, 64, 512):
            m = model(per_pair, chunk, h, d, big, workers, args.bandwidth)
            print(
                f"| {workers} | {m['pairs']} | {m['tasks']} | {m['compute_s']:.0f} | {m['side']:.1f} "
                f"| {m['moved_gb']:.2f} | {m['network_s']:.1f} | {m['depth']} ({m['cross_depth']}) |"
            )


if __name__ == "__main__":
    main()
