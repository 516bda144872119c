"""Sigmoid attention on the CPU: attncomp's fused kernel against PyTorch's eager sigmoid attention
(PyTorch has no fused one: SDPA and FlexAttention normalise by a softmax), side by side in one run.

    python -m benchmarks.sigmoid_attention          # causal, H=8 D=64, float32, 2 threads
    python -m benchmarks.sigmoid_attention --quick  # smaller sizes
    python -m benchmarks.sigmoid_attention --write  # and keep the table in benchmarks/RESULTS.md

The peer computes ``where(causal, sigmoid(q kᵀ / sqrt(D) - log S), 0) @ v`` with a T x S buffer, as
a FlashSigmoid user without a fused kernel writes it.  The two are called alternately; a ratio is
the median of the per-pair ratios (attncomp's time over the peer's: below 1.0 attncomp is faster).
The softmax row is attncomp's causal softmax attention at the same size, for scale.
"""

from __future__ import annotations

import argparse
import math
import os

import numpy as np

os.environ.setdefault("NUMBA_NUM_THREADS", "2")

import attncomp as ac  # noqa: E402
from benchmarks import peers, results_file, specs  # noqa: E402
from benchmarks.timing import check, paired  # noqa: E402
from examples.sigmoid_attention import causal_sigmoid  # noqa: E402


def eager(torch, q, k, v, backward: bool = False, d_out=None):
    """PyTorch's sigmoid attention, op by op (a T x S buffer); with ``backward``, dq by autograd."""
    tq, tk, tv = (torch.from_numpy(x).requires_grad_(backward) for x in (q, k, v))
    t, s = q.shape[-2], k.shape[-2]
    scores = tq @ tk.transpose(-1, -2) * q.shape[-1] ** -0.5 - math.log(s)
    causal = torch.ones(t, s, dtype=torch.bool).tril()
    out = torch.where(causal, torch.sigmoid(scores), 0.0) @ tv
    if not backward:
        return out.numpy()
    out.backward(torch.from_numpy(d_out))
    return tq.grad.numpy()


def rows(quick: bool, repeats: int) -> list[str]:
    torch = peers.torch_or_none()
    if torch is None:
        return ["sigmoid attention: torch is absent, nothing to compare with"]
    torch.set_num_threads(int(os.environ["NUMBA_NUM_THREADS"]))
    rng = np.random.default_rng(0)
    lines = [f"{'causal, H=8 D=64, float32':<42} {'attncomp':>10} {'peer':>10} {'ratio':>7}"]
    for t in [1024] if quick else [2048, 4096]:
        q, k, v = (rng.standard_normal((1, 8, t, 64), dtype=np.float32) for _ in range(3))
        lines += size_rows(torch, q, k, v, rng.standard_normal(q.shape, dtype=np.float32), repeats)
    return lines


def size_rows(torch, q, k, v, d_out, repeats: int) -> list[str]:
    """At one size: the forward and forward+backward against PyTorch's eager sigmoid attention, and
    the forward against attncomp's own causal softmax attention."""
    t = q.shape[-2]
    fn = ac.compile(causal_sigmoid, backend="cpu")
    softmax = ac.compile(specs.causal, backend="cpu")

    def ours():
        return fn.vjp(q, k, v)[1](d_out)[0]

    def theirs():
        return eager(torch, q, k, v, backward=True, d_out=d_out)

    check(f"sigmoid T={t}", fn(q, k, v), eager(torch, q, k, v))
    check(f"sigmoid dq T={t}", ours(), theirs())
    cases = [
        (f"sigmoid forward T=S={t} (torch eager)", lambda: fn(q, k, v), lambda: eager(torch, q, k, v), repeats),
        (f"sigmoid forward+backward T=S={t} (torch)", ours, theirs, max(2, repeats // 2)),
        (f"sigmoid forward T=S={t} (attncomp softmax)", lambda: fn(q, k, v), lambda: softmax(q, k, v), repeats),
    ]
    lines = []
    for name, mine_fn, peer_fn, n in cases:
        mine, other, ratio = paired(mine_fn, peer_fn, n)
        lines.append(f"{name:<42} {mine * 1e3:8.1f}ms {other * 1e3:8.1f}ms {ratio:7.2f}")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke run")
    parser.add_argument("--repeats", type=int, default=7)
    results_file.add_option(parser)
    args = parser.parse_args(argv)
    with results_file.recorded(args, "benchmarks.sigmoid_attention", argv):
        print(peers.blas_kernels())
        print("\n".join(rows(args.quick, args.repeats)))


if __name__ == "__main__":
    main()
