"""bf16 on the CPU: one generic spec in bf16 and in float32, against torch SDPA in the same type.

    python -m benchmarks.float_types           # the rows benchmarks.cpu prints too
    python -m benchmarks.float_types --quick

Ratios are attncomp's time over the peer's, the two called alternately, the median of
the per-pair ratios.  The decode rows compare a bf16 decoder step with a float32 one
over the same cache (half the bytes): alternated as they are, then with the CPU's caches
flushed before each step (each cache read from memory, as in a model of many layers).
"""

from __future__ import annotations

import argparse
import os
import time

import ml_dtypes
import numpy as np

os.environ.setdefault("NUMBA_NUM_THREADS", "2")

import attncomp as ac  # noqa: E402
from benchmarks import peers, results_file, specs  # noqa: E402
from benchmarks.timing import paired  # noqa: E402

BF16 = ml_dtypes.bfloat16


def causal_rows(quick: bool, repeats: int) -> list[str]:
    torch = peers.torch_or_none()
    if torch is None:
        return ["  (torch absent: no bf16 peer)"]
    t = 512 if quick else 2048
    rng = np.random.default_rng(0)
    base = [rng.standard_normal((1, 8, t, 64)).astype(np.float32) for _ in range(3)]
    fn = ac.compile(specs.causal_any, backend="cpu")
    lines = []
    for name, np_type, torch_type in (("bf16", BF16, torch.bfloat16), ("f32", np.float32, torch.float32)):
        arrays = [x.astype(np_type) for x in base]
        tensors = [torch.from_numpy(x).to(torch_type) for x in base]

        def theirs(tensors=tensors):
            with torch.no_grad():
                return torch.nn.functional.scaled_dot_product_attention(*tensors, is_causal=True)

        ours = fn.for_dtype(name)
        got = ours(*arrays).astype(np.float32)
        want = theirs().float().numpy()
        error = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
        mine, peer, ratio = paired(lambda arrays=arrays, ours=ours: ours(*arrays), theirs, repeats)
        lines.append(
            f"  causal T={t} H=8 D=64 {name}: attncomp {mine * 1e3:.1f} ms, torch SDPA {peer * 1e3:.1f} ms, "
            f"ratio {ratio:.2f} (max difference {error:.1e} of the largest output)"
        )
    return lines


def alibi_rows(quick: bool, repeats: int) -> list[str]:
    """bf16 causal ALiBi with float32 slopes against the same spec with bf16 slopes: a float32
    parameter fuses as a bf16 one does, its scores computed in float32 either way."""
    t = 512 if quick else 2048
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 8, t, 64)).astype(BF16) for _ in range(3))
    slopes = 2.0 ** -np.arange(1, 9, dtype=np.float32)
    f32_slopes = ac.compile(specs.causal_alibi_f32_slopes, backend="cpu")
    bf16_slopes = ac.compile(specs.causal_alibi_any, backend="cpu")
    got = f32_slopes(q, k, v, slopes)
    want = bf16_slopes(q, k, v, slopes.astype(BF16))
    error = float(np.max(np.abs(got.astype(np.float32) - want.astype(np.float32))) / np.max(np.abs(want)))
    bf16 = slopes.astype(BF16)
    mine, peer, ratio = paired(lambda: f32_slopes(q, k, v, slopes), lambda: bf16_slopes(q, k, v, bf16), repeats)
    return [
        f"  causal ALiBi T={t} H=8 D=64 bf16: float32 slopes {mine * 1e3:.1f} ms ({got.dtype} result), bf16 slopes "
        f"{peer * 1e3:.1f} ms, ratio {ratio:.2f} (max difference {error:.1e} of the largest output)"
    ]


def decode_rows(quick: bool, repeats: int) -> list[str]:
    cache = 1024 if quick else 4096
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, 32, cache, 128)).astype(np.float32)
    k, v = (rng.standard_normal((1, 8, cache, 128)).astype(np.float32) for _ in range(2))
    fn = ac.compile(specs.gqa_decode_any, backend="cpu")
    steps = {}
    for name, np_type in (("bf16", BF16), ("f32", np.float32)):
        dec = fn.decoder(max_len=cache, dtype=name)
        a = [x.astype(np_type) for x in (q, k, v)]
        dec(*(x[:, :, :-1] for x in a))  # prefill all but the last token

        def step(dec=dec, a=a):
            dec.length = cache - 1  # the same step again: append the last token, attend over all
            return dec(*(x[:, :, -1:] for x in a))

        steps[name] = (step, sum(c.nbytes for c in dec.cache.values()))
    mine, peer, ratio = paired(steps["bf16"][0], steps["f32"][0], repeats * 5)
    cold_mine, cold_peer, cold_ratio = paired_cold(steps["bf16"][0], steps["f32"][0], repeats * 5)
    return [
        f"  decode step GQA 32/8 D=128, {cache} cached: bf16 {mine * 1e3:.2f} ms ({steps['bf16'][1] / 1e6:.0f} MB "
        f"cached), f32 {peer * 1e3:.2f} ms ({steps['f32'][1] / 1e6:.0f} MB), ratio bf16/f32 {ratio:.2f}",
        f"    the same, each step's cache read from memory (the CPU's caches flushed before each step): "
        f"bf16 {cold_mine * 1e3:.2f} ms, f32 {cold_peer * 1e3:.2f} ms, ratio {cold_ratio:.2f}",
    ]


def paired_cold(ours, theirs, repeats: int) -> tuple[float, float, float]:
    """As ``timing.paired``, with the CPU's caches flushed (a read of 96 MB, untimed) before each
    call: what a step costs in a model of many layers, whose caches do not stay in L3 between
    one layer's step and the next.  Without the flush a cache that fits in L3 (bf16's 17 MB here,
    not float32's 34) is read from there."""
    flush = np.ones(96 * 2**20 // 8)
    ours(), theirs()
    mine, peer = [], []
    for _ in range(repeats):
        for call, times in ((ours, mine), (theirs, peer)):
            flush.sum()
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
    ratios = np.array(mine) / np.array(peer)
    return float(np.median(mine)), float(np.median(peer)), float(np.median(ratios))


def float_type_rows(quick: bool, repeats: int) -> list[str]:
    rows = [*causal_rows(quick, repeats), *alibi_rows(quick, repeats), *decode_rows(quick, repeats)]
    return ["bf16 and float32, one generic spec:", *rows]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller sizes")
    parser.add_argument("--repeats", type=int, default=5)
    results_file.add_option(parser)
    args = parser.parse_args(argv)
    with results_file.recorded(args, "benchmarks.float_types", argv):
        print(peers.blas_kernels())
        for line in float_type_rows(args.quick, args.repeats):
            print(line)


if __name__ == "__main__":
    main()
