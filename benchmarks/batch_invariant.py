"""What batch invariance costs: ``ac.compile(..., batch_invariant=True)`` against the default.

    python -m benchmarks.batch_invariant [--quick] [--repeats N] [--backend cpu|cuda]

(a) one paged decode step of 64 sequences of random lengths 128..4096 (8 heads, D = 64);
(b) one ``fn.decoder`` step of a single sequence of 8192 positions, 8 heads;
(c) the same with one key/value head for 8 query heads (GQA): one unit of work, which the default
    splits over the threads by their count and the batch-invariant function at fixed key positions.

Each pair of functions runs the same inputs, called alternately; the ratio is the median of
the per-pair ratios (batch-invariant time over default time).  Paged steps and decoder steps
append their token, so each repeat grows every sequence by one position, in both alike.
"""

from __future__ import annotations

import argparse

import numpy as np

import attncomp as ac
from benchmarks import results_file, specs
from benchmarks.timing import paired

H, D = 8, 64


def _tokens(rng: np.random.Generator, n: int, heads: tuple[int, int, int] = (H, H, H)) -> tuple[np.ndarray, ...]:
    return tuple(rng.standard_normal((1, h, n, D), dtype=np.float32) for h in heads)


def paged_row(quick: bool, repeats: int, backend: str) -> str:
    n_seq, longest = (16, 1024) if quick else (64, 4096)
    rng = np.random.default_rng(8)
    lengths = rng.integers(128, longest + 1, size=n_seq)
    page = 16
    pages = int(sum(-(-(n + 4 * repeats + 64) // page) for n in lengths))
    servers = [
        ac.compile(specs.causal, backend=backend, batch_invariant=on).paged_decoder(page_size=page, num_pages=pages)
        for on in (True, False)
    ]
    seqs = [[], []]
    for n in lengths:
        history = _tokens(rng, int(n))
        for srv, own in zip(servers, seqs):
            own.append(srv.new())
            srv.step({own[-1]: history})
    tokens = [_tokens(rng, 1) for _ in lengths]
    invariant, default = ({s: t for s, t in zip(own, tokens)} for own in seqs)
    ours, theirs, ratio = paired(lambda: servers[0].step(invariant), lambda: servers[1].step(default), repeats)
    return (
        f"  paged decode step ({backend}), {n_seq} sequences of random lengths 128..{longest}: batch-invariant "
        f"{ours * 1e3:.2f} ms, default {theirs * 1e3:.2f} ms, ratio {ratio:.2f}"
    )


def decoder_row(quick: bool, repeats: int, backend: str, kv_heads: int) -> str:
    length = 2048 if quick else 8192
    spec = specs.causal if kv_heads == H else specs.gqa_decode
    rng = np.random.default_rng(9)
    history = _tokens(rng, length, (H, kv_heads, kv_heads))
    token = _tokens(rng, 1, (H, kv_heads, kv_heads))
    decoders = []
    for on in (True, False):
        dec = ac.compile(spec, backend=backend, batch_invariant=on).decoder(max_len=length + 4 * repeats + 8)
        dec(*history)
        decoders.append(dec)
    ours, theirs, ratio = paired(lambda: decoders[0](*token), lambda: decoders[1](*token), repeats)
    heads = f"{H} heads" if kv_heads == H else f"{H} query heads, {kv_heads} key/value head"
    return (
        f"  fn.decoder step ({backend}), one sequence of {length} positions, {heads}: batch-invariant "
        f"{ours * 1e6:.0f} us, default {theirs * 1e6:.0f} us, ratio {ratio:.2f}"
    )


def rows(quick: bool, repeats: int, backend: str = "cpu") -> list[str]:
    return [
        paged_row(quick, repeats, backend),
        decoder_row(quick, repeats, backend, H),
        decoder_row(quick, repeats, backend, 1),
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller sizes")
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--backend", default="cpu", choices=["cpu", "cuda"])
    results_file.add_option(parser)
    args = parser.parse_args(argv)
    with results_file.recorded(args, "benchmarks.batch_invariant", argv):
        for line in rows(args.quick, args.repeats, args.backend):
            print(line)


if __name__ == "__main__":
    main()
