"""8-bit key/value caches on the CPU: a decode step over an f8e4m3 (and f8e5m2) cache against a bf16
one, for ``fn.decoder`` and for ``fn.paged_decoder``'s pool.

    python -m benchmarks.cache_types           # GQA 32/8, D = 128, 16384 cached positions
    python -m benchmarks.cache_types --quick   # 4096 cached positions

Both decoders run the same generic spec on bf16 inputs; only ``cache=`` differs.  The time ratio
is the 8-bit step's over the bf16 step's, the two called alternately, the median of the per-pair
ratios (``timing.paired``), then the same with the CPU's caches flushed before each step
(``float_types.paired_cold``).  The memory ratio is the 8-bit cache's bytes, scales included,
over the bf16 cache's.  The error is the 8-bit step's output against the bf16 one's.  The paged
rows serve 4 sequences of a quarter of the cached positions each, in pages of 16, prefilled by
steps of 512 tokens; a step decodes one token for each.
"""

from __future__ import annotations

import argparse
import os

import ml_dtypes
import numpy as np

os.environ.setdefault("NUMBA_NUM_THREADS", "2")

import attncomp as ac  # noqa: E402
from benchmarks import results_file, specs  # noqa: E402
from benchmarks.float_types import paired_cold  # noqa: E402
from benchmarks.timing import paired  # noqa: E402

HEADS, KV_HEADS, D = 32, 8, 128


def decode_step(fn: ac.CompiledFunction, arrays: list[np.ndarray], cached: int, cache: str | None):
    """A decoder over ``cached`` positions of ``arrays`` and a call running its next step again and
    again (the last token appended at the same place, attending over every position)."""
    dec = fn.decoder(max_len=cached + 1, dtype="bf16", cache=cache)
    q, k, v = arrays
    dec(q[:, :, :1], k[:, :, :cached], v[:, :, :cached])  # one query row: the spec's T and S differ

    def step():
        dec.length = cached
        return dec(*(x[:, :, cached:] for x in arrays))

    return dec, step


def cache_type_rows(quick: bool, repeats: int) -> list[str]:
    cached = 4096 if quick else 16384
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, HEADS, cached + 1, D), dtype=np.float32).astype(ml_dtypes.bfloat16)
    k, v = (
        rng.standard_normal((1, KV_HEADS, cached + 1, D), dtype=np.float32).astype(ml_dtypes.bfloat16) for _ in "kv"
    )
    fn = ac.compile(specs.gqa_decode_any, backend="cpu")
    base, base_step = decode_step(fn, [q, k, v], cached, None)
    base_bytes = sum(c.nbytes for c in base.cache.values())
    want = base_step().astype(np.float32)
    lines = [f"decode step GQA {HEADS}/{KV_HEADS} D={D}, {cached} cached, bf16 inputs: 8-bit caches against bf16"]
    for cache in ("f8e4m3", "f8e5m2"):
        dec, step = decode_step(fn, [q, k, v], cached, cache)
        memory = sum(c.nbytes for c in dec.cache.values()) / base_bytes
        lines.append(compared(cache, step, base_step, want, memory, repeats))
    return lines


def compared(cache: str, step, base_step, want: np.ndarray, memory: float, repeats: int) -> str:
    """A row: an 8-bit step against the bf16 one, alternated (warm, and with caches flushed), its
    memory ratio and its largest difference from the bf16 step's output."""
    got = step().astype(np.float32)
    error = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
    mine, peer, ratio = paired(step, base_step, repeats)
    _, _, cold = paired_cold(step, base_step, repeats)
    return (
        f"  {cache}: {mine * 1e3:.2f} ms, bf16 {peer * 1e3:.2f} ms, time ratio {ratio:.2f} "
        f"(caches flushed before each step: {cold:.2f}), memory ratio {memory:.3f} (scales included), "
        f"max difference {error:.1e} of the largest output"
    )


SEQUENCES, PAGE, PREFILL = 4, 16, 512


def paged_step(fn: ac.CompiledFunction, arrays: list[np.ndarray], cached: int, cache: str | None):
    """A pool of ``SEQUENCES`` sequences, ``cached`` positions in all, of ``arrays`` (one per sequence:
    its q, k, v), and a call running their next step again and again (each sequence cut back to its
    cached positions: the new token goes to the same slot, attending over every position)."""
    each = cached // SEQUENCES
    srv = fn.paged_decoder(page_size=PAGE, num_pages=SEQUENCES * (each // PAGE + 1), dtype="bf16", cache=cache)
    seqs = [srv.new() for _ in arrays]
    for at in range(0, each, PREFILL):
        srv.step({s: tuple(x[:, :, at : min(at + PREFILL, each)] for x in a) for s, a in zip(seqs, arrays)})
    new = {s: tuple(x[:, :, each:] for x in a) for s, a in zip(seqs, arrays)}

    def step():
        for s in seqs:
            srv.pool.sequence(s).length = each  # its page for the new token stays held
        ys = srv.step(new)
        return np.concatenate([ys[s] for s in seqs])

    return srv, step


def paged_rows(quick: bool, repeats: int) -> list[str]:
    cached = 4096 if quick else 16384
    each = cached // SEQUENCES
    rng = np.random.default_rng(1)

    def draw(heads):
        return rng.standard_normal((1, heads, each + 1, D), dtype=np.float32).astype(ml_dtypes.bfloat16)

    arrays = [[draw(HEADS), draw(KV_HEADS), draw(KV_HEADS)] for _ in range(SEQUENCES)]
    fn = ac.compile(specs.gqa_decode_any, backend="cpu")
    base, base_step = paged_step(fn, arrays, cached, None)
    want = base_step().astype(np.float32)
    lines = [
        f"paged decode step GQA {HEADS}/{KV_HEADS} D={D}, {SEQUENCES} sequences of {each} cached, pages of {PAGE}, "
        "bf16 inputs: 8-bit pools against a bf16 pool"
    ]
    for cache in ("f8e4m3", "f8e5m2"):
        srv, step = paged_step(fn, arrays, cached, cache)
        memory = sum(a.nbytes for a in srv.pool.arrays) / sum(a.nbytes for a in base.pool.arrays)
        lines.append(compared(cache, step, base_step, want, memory, repeats))
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="4096 cached positions")
    parser.add_argument("--repeats", type=int, default=25)
    parser.add_argument("--only", choices=["decoder", "paged"], help="one kind of row")
    results_file.add_option(parser)
    args = parser.parse_args(argv)
    rows = {"decoder": cache_type_rows, "paged": paged_rows}
    with results_file.recorded(args, "benchmarks.cache_types", argv):
        for kind, make in rows.items():
            if args.only in (None, kind):
                for line in make(args.quick, args.repeats):
                    print(line, flush=True)


if __name__ == "__main__":
    main()
