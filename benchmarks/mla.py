"""MLA's shapes (examples/mla.py) on the CPU against PyTorch's SDPA, side by side.

    python -m benchmarks.mla            # decode: 16 heads, 8192 cached; prefill: T = 2048
    python -m benchmarks.mla --quick    # 2048 cached; prefill T = 512

- **Absorbed decode**: one new token of 16 heads over a latent of 576 features per cached
  token, the values its first 512, float32.  attncomp's decoder step (the spec's decoder,
  its caches filled by a prefill, each timed step appending one token) against SDPA on the
  same shapes: the query against the
  latent expanded over the heads (a view, no copy) and its first 512 features as values.
- **Prefill**: causal, queries and keys of 192 features, values of 128, 16 heads, float32,
  against SDPA with ``is_causal=True``.

The two are called alternately and the ratio is the median of the per-pair ratios
(``benchmarks.timing.paired``); below 1, attncomp is faster.
"""

from __future__ import annotations

import argparse
import os

import numpy as np

os.environ.setdefault("NUMBA_NUM_THREADS", "2")

import attncomp as ac  # noqa: E402
from benchmarks import results_file
from benchmarks.peers import torch_or_none  # noqa: E402
from benchmarks.timing import check, paired  # noqa: E402
from tests.conftest import load_example  # noqa: E402

mla = load_example("mla")


def decode_row(torch, cached: int, repeats: int) -> str:
    rng = np.random.default_rng(0)
    q, latent = mla.make_inputs(rng, B=1, H=16, T=1, S=cached + 1, decode=True)
    fn = ac.compile(mla.mla_absorbed_decode, backend="cpu")
    decoder = fn.decoder(cached + 2 * repeats + 8)  # each step appends one token
    prompt = np.zeros((1, 16, cached, q.shape[-1]), np.float32)
    decoder(prompt, latent[:, :, :cached])  # the cache: the latent of every earlier token

    def ours():
        return decoder(q, latent[:, :, cached:])

    tq, tl = torch.from_numpy(q), torch.from_numpy(latent)
    keys, values = tl.expand(1, 16, -1, -1), tl[..., : mla.VALUE_FEATURES].expand(1, 16, -1, -1)

    def theirs():
        with torch.no_grad():
            return torch.nn.functional.scaled_dot_product_attention(tq, keys, values, scale=mla.QK_FEATURES**-0.5)

    # the first step: the same keys as SDPA's (later steps see the steps before them too)
    check("decode", np.asarray(ours()), theirs().numpy())
    mine, peer, ratio = paired(ours, theirs, repeats)
    return f"| absorbed decode, 16 heads, {cached} cached | {mine * 1e3:.2f} ms | {peer * 1e3:.2f} ms | {ratio:.3f} |"


def prefill_row(torch, length: int, repeats: int) -> str:
    rng = np.random.default_rng(1)
    q, k, v = mla.make_inputs(rng, B=1, H=16, T=length, S=length)
    fn = ac.compile(mla.mla_prefill, backend="cpu")
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))

    def theirs():
        with torch.no_grad():
            return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=True)

    check("prefill", np.asarray(fn(q, k, v)), theirs().numpy())
    mine, peer, ratio = paired(lambda: fn(q, k, v), theirs, repeats)
    return (
        f"| prefill 192/128, 16 heads, T = {length}, causal | {mine * 1e3:.2f} ms | {peer * 1e3:.2f} ms | {ratio:.3f} |"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=11)
    results_file.add_option(parser)
    options = parser.parse_args(argv)
    with results_file.recorded(options, "benchmarks.mla", argv):
        torch = torch_or_none()
        if torch is None:
            raise SystemExit("benchmarks.mla compares with PyTorch's SDPA: pip install torch")
        print("| case (float32, 2 threads) | attncomp | SDPA | ratio |")
        print("|---|---:|---:|---:|")
        print(decode_row(torch, 2048 if options.quick else 8192, options.repeats))
        print(prefill_row(torch, 512 if options.quick else 2048, max(3, options.repeats // 2)))


if __name__ == "__main__":
    main()
