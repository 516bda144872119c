"""Context parallelism: the layouts' balance, and a ring on 2 processes against one process.

    python -m benchmarks.context_parallel           # causal T = 16384, H = 4, D = 64
    python -m benchmarks.context_parallel --quick   # T = 4096

1. **Balance**, computed from the layout (no processes): the live-tile imbalance (the most
   loaded rank's live tiles over the mean) of causal attention at T = 65536 on 8 ranks,
   and of a document mask of 16 packed documents, for the contiguous split and for
   ``balance``'s deal, counted with the CPU kernel's tiles.
2. **The ring**, measured: forward and backward of causal attention on 2 gloo processes of
   one thread each (``context_parallel``), against the same compiled function's ``vjp`` in
   one process of 2 threads, called alternately (a step of one, then of the other; the
   ratio is the median of the per-pair ratios).  Then the bytes each rank sent per ring
   step against the ring's lower bound: the forward must pass on a rank's keys and values
   (one shard of each) per step; the backward also their gradients' accumulators (float32).
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

os.environ.setdefault("NUMBA_NUM_THREADS", "2")

import attncomp as ac  # noqa: E402
import attncomp.distributed as acd  # noqa: E402
from attncomp.distributed.layout import Layout  # noqa: E402
from attncomp.distributed.spec import standin  # noqa: E402
from benchmarks import results_file, specs  # noqa: E402


def packed_documents(rng: np.random.Generator, length: int, documents: int) -> np.ndarray:
    """Document ids of ``documents`` packed documents of random lengths (a Dirichlet split)."""
    sizes = np.maximum(1, np.round(rng.dirichlet(np.ones(documents)) * length)).astype(int)
    sizes[-1] = length - sizes[:-1].sum()
    return np.repeat(np.arange(documents, dtype=np.int32), sizes)[None, :]


def balance_table(length: int = 65536, world: int = 8) -> list[str]:
    from examples.document_mask import causal_document_mask

    fn = ac.compile(specs.causal, backend="cpu")
    block = next(p.block_q for p in fn.compilation.passes if p.name == "flash-tiling")
    q = standin((1, 1, length, 64), "f32")
    rows = ["| mask | layout | chunks per rank | live-tile imbalance |", "|---|---|---:|---:|"]
    start = time.perf_counter()
    dealt = acd.balance(fn, world, q, q, q, block=block)
    seconds = time.perf_counter() - start
    contiguous = Layout(world, length, length // world, tuple(range(world)), _rows(dealt, world), block)
    rows.append(f"| causal T = {length} | contiguous | 1 | {contiguous.imbalance:.3f} |")
    rows.append(f"| causal T = {length} | balance | {dealt.chunks_per_rank} | {dealt.imbalance:.3f} |")
    documents = ac.compile(causal_document_mask, backend="cpu")
    doc = packed_documents(np.random.default_rng(0), length, 16)
    dealt_docs = acd.balance(documents, world, q, q, q, doc, block=block)
    contiguous_docs = Layout(world, length, length // world, tuple(range(world)), _rows(dealt_docs, world), block)
    rows.append(f"| 16 packed documents | contiguous | 1 | {contiguous_docs.imbalance:.3f} |")
    rows.append(f"| 16 packed documents | balance | {dealt_docs.chunks_per_rank} | {dealt_docs.imbalance:.3f} |")
    rows.append("")
    rows.append(f"{world} ranks, tiles of {block} (the CPU kernel's query block); `balance` took {seconds:.1f} s.")
    return rows


def _rows(layout: Layout, world: int) -> tuple[float, ...]:
    """The contiguous split's work per rank, from a layout's work per chunk (in sequence order)."""
    return tuple(np.asarray(layout.work).reshape(world, -1).sum(axis=1))


def worker(rank: int, world: int, port: int, shape: tuple[int, ...], pipe) -> None:
    import numba
    import torch
    import torch.distributed as dist

    numba.set_num_threads(1)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    fn = ac.compile(specs.causal, backend="cpu")
    rng = np.random.default_rng(0)
    q, k, v, d_out = (rng.standard_normal(shape).astype(np.float32) for _ in range(4))
    layout = acd.balance(fn, world, q, k, v)
    cp = acd.context_parallel(fn, layout)
    shards = [layout.shard(torch.from_numpy(x), rank) for x in (q, k, v, d_out)]
    while pipe.recv() == "go":
        args = [s.clone().requires_grad_(True) for s in shards[:3]]
        dist.barrier()
        start = time.perf_counter()
        cp.comm.sent_bytes = 0
        out = cp(*args)
        forward_bytes = cp.comm.sent_bytes
        out.backward(shards[3])
        seconds = time.perf_counter() - start
        kv_bytes = 2 * shards[1].numel() * 4  # one shard of keys and one of values, float32
        pipe.send((seconds, forward_bytes, cp.comm.sent_bytes - forward_bytes, cp.last["steps"], kv_bytes))
    dist.destroy_process_group()


def ring_table(length: int, repeats: int) -> list[str]:
    import multiprocessing as mp

    from tests.context_parallel.cp_worker import free_port

    shape = (1, 4, length, 64)
    context = mp.get_context("spawn")
    port = free_port()
    pipes, processes = [], []
    for rank in range(2):
        ours, theirs = context.Pipe()
        process = context.Process(target=worker, args=(rank, 2, port, shape, theirs))
        process.start()
        pipes.append(ours)
        processes.append(process)
    fn = ac.compile(specs.causal, backend="cpu")
    rng = np.random.default_rng(0)
    q, k, v, d_out = (rng.standard_normal(shape).astype(np.float32) for _ in range(4))

    def sharded():
        for pipe in pipes:
            pipe.send("go")
        return [pipe.recv() for pipe in pipes]

    def single() -> float:
        start = time.perf_counter()
        _, pullback = fn.vjp(q, k, v)
        pullback(d_out)
        return time.perf_counter() - start

    sharded(), single()  # compiles, warms up
    ratios, ring, one, reports = [], [], [], []
    for _ in range(repeats):
        reports = sharded()
        ring_seconds = max(r[0] for r in reports)
        one_seconds = single()
        ring.append(ring_seconds)
        one.append(one_seconds)
        ratios.append(ring_seconds / one_seconds)
    for pipe in pipes:
        pipe.send("stop")
    for process in processes:
        process.join()
    _, forward_bytes, backward_bytes, steps, kv_bytes = reports[0]
    # the backward's lower bound: keys and values, and their gradients' float32 accumulators, per
    # step, and the accumulators' way home
    backward_bound = steps * 2 * kv_bytes + kv_bytes
    return [
        "| causal fwd+bwd, B=1 H=4 D=64 | 2 processes x 1 thread | 1 process x 2 threads | ratio |",
        "|---|---:|---:|---:|",
        f"| T = {length} | {np.median(ring):.3f} s | {np.median(one):.3f} s | {np.median(ratios):.3f} |",
        "",
        "| bytes each rank sent | measured | ring's lower bound | ratio |",
        "|---|---:|---:|---:|",
        f"| forward, {steps} step(s) | {forward_bytes} | {steps * kv_bytes} "
        f"| {forward_bytes / (steps * kv_bytes):.3f} |",
        f"| backward | {backward_bytes} | {backward_bound} | {backward_bytes / backward_bound:.3f} |",
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="T = 4096 for the ring")
    parser.add_argument("--repeats", type=int, default=5)
    results_file.add_option(parser)
    options = parser.parse_args(argv)
    with results_file.recorded(options, "benchmarks.context_parallel", argv):
        print("\n".join(balance_table()))
        print()
        print("\n".join(ring_table(4096 if options.quick else 16384, options.repeats)))


if __name__ == "__main__":
    main()
