"""Training with the sequence sharded across processes: context parallelism on torch.distributed.

    torchrun --nproc-per-node 2 examples/context_parallel.py            # gloo, on the CPU
    torchrun --nproc-per-node 2 examples/context_parallel.py --steps 20 --half 128

Each rank holds its shard of every sequence (the chunks ``balance`` deals it: for causal
ALiBi, a zigzag) and runs the whole model on it: embeddings, norms and MLPs are
position-wise, and the attention, made context-parallel, passes keys and values around
the ring.  The ALiBi slopes are learnt.  The model's gradients are summed over the ranks
(as DDP would), the shared slopes' included (``shared_grads="local"``).  Rank 0 also
trains the same model on whole sequences in one process, through ``fn.to_torch()``, and
prints both loss curves: they agree step by step.

The model and the task are ``examples/train_tiny_lm.py``'s: a sequence of random tokens
followed by itself, the loss taken on the copy.
"""

import argparse
import os
import sys
from pathlib import Path

import numpy as np

import attncomp as ac
import attncomp.distributed as acd

sys.path.insert(0, str(Path(__file__).resolve().parent))  # train_tiny_lm.py sits next to this file
import train_tiny_lm as tiny  # noqa: E402

#: the attention every rank runs: causal ALiBi with soft-capped scores and learnt slopes
alibi_softcap = tiny.alibi_softcap


def batches(seed: int, batch: int, half: int, vocab: int):
    """Copy-task sequences of ``2 * half + 1`` tokens: inputs, next-token targets, the loss weights."""
    rng = np.random.default_rng(seed)
    while True:
        first = rng.integers(0, vocab, (batch, half))
        tokens = np.concatenate([first, first, first[:, :1]], axis=1)
        weights = np.zeros((batch, 2 * half), dtype=np.float32)
        weights[:, half - 1 :] = 1.0  # positions half-1 .. predict the copied tokens
        yield tokens[:, :-1], tokens[:, 1:], weights


def step_loss(torch, model, tokens, targets, weights, total: float):
    logits = model(tokens)
    losses = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none"
    )
    return (losses * weights.reshape(-1)).sum() / total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--half", type=int, default=32, help="the sequence is 2 * half tokens")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--check", type=float, default=1e-3, help="the largest relative loss difference allowed")
    options = parser.parse_args()

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    fn = ac.compile(alibi_softcap, backend="cpu")
    vocab, length = 16, 2 * options.half
    q = np.broadcast_to(np.zeros((), np.float32), (options.batch, 2, length, 16))
    layout = acd.balance(fn, world, q, q, q, np.zeros(2, np.float32))  # shapes only: no captured values matter
    attention = acd.context_parallel(fn, layout, shared_grads="local")

    torch.manual_seed(0)
    model = tiny.build_model(torch, attention, vocab=vocab)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    if rank == 0:
        torch.manual_seed(0)
        whole_model = tiny.build_model(torch, fn.to_torch(), vocab=vocab)
        whole_optimizer = torch.optim.Adam(whole_model.parameters(), lr=3e-3)
        print(layout.describe())
        print(f"{'step':>4} {'sharded':>10} {'one process':>12}")

    worst = 0.0
    for step, (tokens, targets, weights) in zip(range(options.steps), batches(0, options.batch, options.half, vocab)):
        tokens, targets, weights = (torch.from_numpy(x) for x in (tokens, targets, weights))
        total = float(weights.sum())
        shard = [layout.shard(x, rank, 1) for x in (tokens, targets, weights)]
        loss = step_loss(torch, model, *shard, total)
        optimizer.zero_grad()
        loss.backward()
        for p in model.parameters():  # what DDP does: the gradients summed over the ranks
            dist.all_reduce(p.grad)
        optimizer.step()
        dist.all_reduce(summed := loss.detach().clone())
        if rank == 0:
            whole = step_loss(torch, whole_model, tokens, targets, weights, total)
            whole_optimizer.zero_grad()
            whole.backward()
            whole_optimizer.step()
            worst = max(worst, abs(summed.item() - whole.item()) / abs(whole.item()))
            print(f"{step:4d} {summed.item():10.5f} {whole.item():12.5f}")
    if rank == 0:
        print(f"largest relative difference: {worst:.2e}")
    # every rank done before any tears its connections down: rank 0 trains the one-process model
    # too, and a peer closing first can abort the other's Gloo threads as the process exits
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0 and worst > options.check:
        print(f"the sharded losses left the one-process ones by {worst:.2e} (> {options.check:g})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    code = main()
    # Under load, a rank whose work is done and whose process group is destroyed can still abort
    # as the interpreter exits ("terminate called without an active exception": a C++ thread
    # object destroyed unjoined), and torchrun then reports the run failed.  Everything is printed
    # and flushed by now: leave without the interpreter's teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
