"""What a small call costs: microseconds per call, attncomp beside PyTorch, alternated pairs.

    python -m benchmarks.call_overhead          # also printed by python -m benchmarks.cpu

A causal spec, H = 4, D = 32, float32, on the cpu backend.  Rows: ``fn(q, k, v)`` on numpy
arrays at T = 1 (beside SDPA on the same data as tensors), the ``fn.to_torch()`` op at T = 1
against SDPA, forward + backward through the op at T = 32 against SDPA's (and, for scale, a
Python ``autograd.Function`` that only clones q: what torch's autograd costs any op whose
backward is Python code), and a decoder step
(one new token over 16 cached) against the same attention as one call of ``fn`` (what the step
adds: appending to the cache and the step's own checks).  Each row alternates the two calls
``--pairs`` times and reports the median time of each and the median of the per-pair ratios.
"""

from __future__ import annotations

import argparse

import numpy as np

import attncomp as ac
from benchmarks import peers, results_file, specs
from benchmarks.timing import paired


def us(seconds: float) -> str:
    return f"{seconds * 1e6:8.1f}"


def rows(pairs: int) -> list[str]:
    torch = peers.torch_or_none()
    fn = ac.compile(specs.causal, backend="cpu")
    rng = np.random.default_rng(0)

    def arrays(t: int) -> list[np.ndarray]:
        return [rng.standard_normal((1, 4, t, 32)).astype(np.float32) for _ in range(3)]

    lines = [f"{'per call, causal H=4 D=32 float32':44s} {'attncomp us':>11s} {'peer us':>8s} {'ratio':>7s}  peer"]

    def row(name: str, ours, theirs, peer: str) -> None:
        mine, other, ratio = paired(ours, theirs, pairs)
        lines.append(f"{name:44s} {us(mine):>11s} {us(other):>8s} {ratio:7.2f}  {peer}")

    q, k, v = arrays(1)
    if torch is not None:
        sdpa = torch.nn.functional.scaled_dot_product_attention
        tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
        row("fn(q, k, v), numpy, T=1", lambda: fn(q, k, v), lambda: sdpa(tq, tk, tv, is_causal=True), "torch SDPA")
        op = fn.to_torch()
        row("fn.to_torch() op, T=1", lambda: op(tq, tk, tv), lambda: sdpa(tq, tk, tv, is_causal=True), "torch SDPA")
        grads = [torch.from_numpy(x).requires_grad_() for x in arrays(32)]
        cotangent = torch.randn((1, 4, 32, 32))

        def ours_fb():
            op(*grads).backward(cotangent)

        def theirs_fb():
            sdpa(*grads, is_causal=True).backward(cotangent)

        row("forward + backward through the op, T=32", ours_fb, theirs_fb, "torch SDPA")

        class Clone(torch.autograd.Function):  # the floor of any op whose backward is Python code
            @staticmethod
            def forward(ctx, q, k, v):
                return q.clone()

            @staticmethod
            def backward(ctx, grad):
                return grad, None, None

        def floor_fb():
            Clone.apply(*grads).backward(cotangent)

        row("  a Python autograd.Function that clones q", floor_fb, theirs_fb, "torch SDPA")
    else:
        lines.append("(torch is not installed: the rows against SDPA are skipped)")
    cached = arrays(17)
    dec = fn.decoder(max_len=64)
    dec(*(x[:, :, :16] for x in cached))
    new = [x[:, :, 16:] for x in cached]

    def step():
        dec.length = 16  # the same step each time: one token appended to 16 cached
        return dec(*new)

    keys = [cached[0][:, :, 16:], cached[1], cached[2]]
    row("decoder step, T=1 over 16 cached", step, lambda: fn(*keys), "fn(q, k, v) of the same 17 keys")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=2000)
    results_file.add_option(parser)
    args = parser.parse_args(argv)
    with results_file.recorded(args, "benchmarks.call_overhead", argv):
        for line in rows(args.pairs):
            print(line)


if __name__ == "__main__":
    main()
