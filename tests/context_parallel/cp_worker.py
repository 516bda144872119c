"""Context-parallel cases run on ``world`` gloo processes; each rank saves its shards' results.

    python -m tests.context_parallel.cp_worker --world 2 --out DIR [--cases causal,window]

Every rank builds the same whole inputs (one seed), shards them with the balanced layout,
calls the context-parallel function, back-propagates its shard of a fixed cotangent and
saves ``DIR/CASE-RANK.npz``: its output shard and the gradients (shards of q, k, v and of
per-position tensors; the whole gradient of shared ones).  The test unshards them and
compares with the single-process call.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

import numpy as np

from tests.context_parallel.cases import CASES, build


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def to_numpy(t):
    import torch

    t = t.detach()
    return t.float().numpy() if t.dtype == torch.bfloat16 else t.numpy()


def run_case(name: str, world: int, rank: int, out: str) -> None:
    import torch

    import attncomp.distributed as acd

    case = CASES[name]
    fn, args, cotangent = build(case, world)
    layout = acd.balance(fn, world, *args, chunks_per_rank=case.get("chunks_per_rank"))
    cp = acd.context_parallel(fn, layout, timeout=120)
    dtype = torch.bfloat16 if case.get("dtype") == "bf16" else None
    shards = []
    for x, sharded in zip(args, case["sharded"]):
        t = torch.from_numpy(x)
        if dtype is not None and t.is_floating_point() and t.dim() == 4:
            t = t.to(dtype)
        t = layout.shard(t, rank, sharded) if sharded is not None else t
        if t.is_floating_point():
            t = t.clone().requires_grad_(True)
        shards.append(t)
    result = cp(*shards)
    saved = {"owner": np.asarray(layout.owner), "chunk": layout.chunk}
    if isinstance(result, tuple):  # the output and each row's max score, which passes no gradient
        result, top = result
        saved["max"] = to_numpy(top)
        assert not top.requires_grad
    d_out = layout.shard(torch.from_numpy(cotangent), rank, -2).to(result.dtype)
    (result.float() * d_out.float()).sum().backward()
    saved["out"] = to_numpy(result)
    saved["steps"] = cp.last["steps"]
    saved["pairs"] = cp.last["pairs"]
    for k, t in enumerate(shards):
        if t.grad is not None:
            saved[f"grad{k}"] = to_numpy(t.grad)
    np.savez(os.path.join(out, f"{name}-{rank}.npz"), **saved)


def main(rank: int, world: int, port: int, out: str, cases: list[str]) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ["ATTNCOMP_QUIET"] = "1"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        for name in cases:
            if name.startswith("error-"):
                from tests.context_parallel.cases import run_error_case

                run_error_case(name, world, rank, out)
            else:
                run_case(name, world, rank, out)
    finally:
        dist.destroy_process_group()
    # every file is written: leave without the interpreter's teardown, which under load can abort
    # (``examples/context_parallel.py`` says why)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", default=",".join(CASES))
    options = parser.parse_args()
    import torch.multiprocessing as mp

    names = options.cases.split(",")
    # forked ranks start with what this process imported (torch, attncomp, Numba): 2 to 2.5 s of
    # imports less a rank (the 4 ranks' run, kernels cached: 10.5 s of CPU instead of 15.9 s);
    # the torchrun test (``test_a_tiny_model_trains_on_two_ranks_as_in_one_process``) starts fresh ones
    mp.start_processes(
        main, args=(options.world, free_port(), options.out, names), nprocs=options.world, start_method="fork"
    )
