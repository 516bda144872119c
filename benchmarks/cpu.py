"""CPU benchmark: attncomp against numpy and PyTorch SDPA, side by side in one run.

    python -m benchmarks.cpu                # the full table (float32, 2 threads)
    python -m benchmarks.cpu --quick        # smaller sizes, for a smoke run
    python -m benchmarks.cpu --plot cpu.png # also draw the times (needs the plot extra)

Ratios are attncomp's time over the peer's: below 1.0 attncomp is faster.  Against
torch, attncomp and torch are called alternately and the ratio is the median of
the per-pair ratios (the times shown are the medians), which the shared machine's
load drifts less; numpy's time is the best of its runs.
Peak memory is the growth of resident memory during one call, sampled every
millisecond in a fresh process.  Compile time is measured in fresh processes
with an empty and with a warm cache directory.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import numpy as np

os.environ.setdefault("NUMBA_NUM_THREADS", "2")

import attncomp as ac  # noqa: E402
from benchmarks import call_overhead, peers, results_file, specs  # noqa: E402
from benchmarks.flash_attn import flash_attn_rows  # noqa: E402
from benchmarks.flex import flex_rows  # noqa: E402
from benchmarks.float_types import float_type_rows  # noqa: E402
from benchmarks.serving import serving_rows  # noqa: E402
from benchmarks.timing import check, paired  # noqa: E402


@dataclass
class Row:
    case: str
    seconds: dict[str, float | None] = field(default_factory=dict)
    note: str = ""
    #: attncomp's time over torch's: the median of per-pair ratios, the two called alternately
    torch_ratio: float | None = None
    #: floating-point operations of the case (4 per query-key pair and head dim: both products)
    flops: float = 0.0


def best_of(fn, repeats: int) -> float:
    fn()  # warm-up: compiles, faults pages in
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def inputs(rng, b, h, t, s, d, kv=None):
    kv = kv or h
    q = rng.standard_normal((b, h, t, d), dtype=np.float32)
    k = rng.standard_normal((b, kv, s, d), dtype=np.float32)
    v = rng.standard_normal((b, kv, s, d), dtype=np.float32)
    return q, k, v


def time_case(name, spec, args, constants, torch_call, numpy_call, repeats, with_numpy=True, pairs=None) -> Row:
    fn = ac.compile(spec, backend="cpu", **constants)
    q, k = args[0], args[1]
    pairs = q.shape[-2] * k.shape[-2] if pairs is None else pairs  # query-key pairs per head
    row = Row(name, flops=4.0 * q.shape[0] * q.shape[1] * pairs * q.shape[-1])
    torch = peers.torch_or_none()
    if torch is not None:
        check(name, fn(*args), torch_call(torch))
        mine, theirs, row.torch_ratio = paired(lambda: fn(*args), lambda: torch_call(torch), max(repeats, 5))
        row.seconds["attncomp"], row.seconds["torch"] = mine, theirs
    else:
        row.seconds["attncomp"] = best_of(lambda: fn(*args), repeats)
    row.seconds["numpy"] = best_of(numpy_call, 1) if with_numpy else None
    return row


def attention_cases(quick: bool, repeats: int) -> list[Row]:
    rng = np.random.default_rng(0)
    rows = []
    t = 256 if quick else 1024
    q, k, v = inputs(rng, 1, 8, t, t, 64)
    rows.append(
        time_case(
            f"dense T=S={t} H=8 D=64",
            specs.dense,
            (q, k, v),
            {},
            lambda torch: peers.torch_attention(torch, q, k, v),
            lambda: peers.numpy_attention(q, k, v),
            repeats,
        )
    )
    for t in [512] if quick else [2048, 8192]:
        q, k, v = inputs(rng, 1, 8, t, t, 64)
        causal_mask = np.tril(np.ones((t, t), dtype=bool))
        rows.append(
            time_case(
                f"causal T=S={t}",
                specs.causal,
                (q, k, v),
                {},
                lambda torch, q=q, k=k, v=v: peers.torch_attention(torch, q, k, v, causal=True),
                lambda q=q, k=k, v=v, m=causal_mask: peers.numpy_attention(q, k, v, m),
                repeats if t < 8192 else 1,
                with_numpy=t < 8192,
                pairs=t * (t + 1) // 2,
            )
        )
    t = 1024 if quick else 8192
    q, k, v = inputs(rng, 1, 8, t, t, 64)
    i, j = np.ogrid[:t, :t]
    window = (j <= i) & (i - j < 256)
    rows.append(
        time_case(
            f"causal window 256 T=S={t}",
            specs.causal_window,
            (q, k, v),
            {"window": 256},
            lambda torch: peers.torch_attention(torch, q, k, v, mask=window),
            lambda: peers.numpy_attention(q, k, v, window),
            1 if t == 8192 else repeats,
            with_numpy=False,
            pairs=int(window.sum()),
        )
    )
    rows.append(data_mask_case(rng, 1024 if quick else 4096, repeats))
    rows.append(position_bias_case(rng, 512 if quick else 2048, repeats))
    cache = 1024 if quick else 4096
    q, k, v = inputs(rng, 1, 32, 1, cache, 128, kv=8)
    rows.append(
        time_case(
            f"decode GQA 32/8 heads D=128 cache={cache}",
            specs.gqa_decode,
            (q, k, v),
            {},
            lambda torch: peers.torch_attention(torch, q, k, v, gqa=True),
            lambda: peers.numpy_attention(q, k, v),
            repeats * 5,
        )
    )
    return rows


def data_mask_case(rng, t: int, repeats: int) -> Row:
    """A boolean ``[1, T, S]`` mask given as data: four packed documents, each causal. SDPA takes the
    same mask; attncomp classifies each tile from the mask's minimum and maximum over it."""
    q, k, v = inputs(rng, 1, 8, t, t, 64)
    i, j = np.ogrid[:t, :t]
    mask = ((i // (t // 4) == j // (t // 4)) & (j <= i))[None]
    return time_case(
        f"4 packed documents as a [1, T, S] boolean mask, T=S={t}",
        specs.data_mask,
        (q, k, v, mask),
        {},
        lambda torch: peers.torch_attention(torch, q, k, v, mask=mask[:, None]),
        lambda: peers.numpy_attention(q, k, v, mask[0]),
        repeats,
        with_numpy=False,
        pairs=int(mask.sum()),
    )


def position_bias_case(rng, t: int, repeats: int) -> Row:
    """T5's attention: a ``[1, H, T, S]`` bias added to unscaled scores; SDPA takes it as its float mask."""
    q, k, v = inputs(rng, 1, 8, t, t, 64)
    bias = rng.standard_normal((1, 8, t, t), dtype=np.float32)
    q8 = q * np.float32(8.0)  # SDPA scales the scores by D**-0.5 = 1/8
    return time_case(
        f"T5 position bias [1, 8, T, S], T=S={t}",
        specs.position_bias,
        (q, k, v, bias),
        {},
        lambda torch: peers.torch_attention(torch, q8, k, v, mask=bias),
        lambda: None,
        repeats,
        with_numpy=False,
    )


# gradients: forward + backward, timed in alternating pairs ------------------------------
def torch_forward_backward(torch, q, k, v, d_out, causal=False, mask=None):
    """SDPA forward and backward; returns the query gradient."""
    tq, tk, tv = (torch.from_numpy(x).requires_grad_() for x in (q, k, v))
    attn_mask = None if mask is None else torch.from_numpy(mask)
    out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, attn_mask=attn_mask, is_causal=causal)
    out.backward(torch.from_numpy(d_out))
    return tq.grad.numpy()


def backward_rows(quick: bool, repeats: int) -> list[str]:
    torch = peers.torch_or_none()
    if torch is None:
        return ["  forward+backward: torch is absent, nothing to compare with"]
    rng = np.random.default_rng(3)
    cases = [(f"causal T=S={t}", specs.causal, {}, t, dict(causal=True)) for t in ([512] if quick else [2048, 8192])]
    t = 1024 if quick else 8192
    i, j = np.ogrid[:t, :t]
    window = (j <= i) & (i - j < 256)
    cases.append((f"causal window 256 T=S={t}", specs.causal_window, {"window": 256}, t, dict(mask=window)))
    lines = [f"  {'forward+backward, H=8 D=64':<34} {'attncomp':>10} {'torch':>10} {'ratio':>7}  GFLOP/s"]
    for name, spec, constants, t, peer in cases:
        q, k, v = inputs(rng, 1, 8, t, t, 64)
        d_out = rng.standard_normal(q.shape, dtype=np.float32)
        fn = ac.compile(spec, backend="cpu", **constants)

        def ours(fn=fn, q=q, k=k, v=v, d_out=d_out):
            _, pullback = fn.vjp(q, k, v)
            return pullback(d_out)[0]

        def theirs(q=q, k=k, v=v, d_out=d_out, peer=peer):
            return torch_forward_backward(torch, q, k, v, d_out, **peer)

        check(name, ours(), theirs())
        n = 1 if "window" in name and not quick else (2 if t >= 8192 else repeats)
        mine, other, ratio = paired(ours, theirs, n)
        # 2 products forward, 5 backward (qkᵀ again, d_out vᵀ, and the three gradients), half of them causal
        visible = t * t / 2 if "window" not in name else t * 256
        flops = 7 * 2 * visible * 64 * 8
        lines.append(f"  {name:<34} {mine * 1e3:8.1f}ms {other * 1e3:8.1f}ms {ratio:7.2f}  {flops / mine / 1e9:7.1f}")
    return lines


def dropout_rows(quick: bool, repeats: int, rate: float = 0.1) -> list[str]:
    """Causal attention with dropout of the probabilities, forward + backward: against SDPA's
    ``dropout_p`` (another random mask, the same law) and against attncomp without dropout."""
    torch = peers.torch_or_none()
    if torch is None:
        return ["  dropout: torch is absent, nothing to compare with"]
    t = 512 if quick else 2048
    rng = np.random.default_rng(5)
    q, k, v = inputs(rng, 1, 8, t, t, 64)
    d_out = rng.standard_normal(q.shape, dtype=np.float32)
    dropped, plain = ac.compile(specs.causal_dropout, backend="cpu", rate=rate), ac.compile(specs.causal, backend="cpu")
    seeds = iter(range(1 << 62))

    def ours():
        _, pullback = dropped.vjp(q, k, v, np.int64(next(seeds)))
        return pullback(d_out)[0]

    def without():
        _, pullback = plain.vjp(q, k, v)
        return pullback(d_out)[0]

    def theirs():
        tq, tk, tv = (torch.from_numpy(x).requires_grad_() for x in (q, k, v))
        out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, dropout_p=rate, is_causal=True)
        out.backward(torch.from_numpy(d_out))
        return tq.grad.numpy()

    if not (np.all(np.isfinite(ours())) and np.all(np.isfinite(theirs()))):
        raise AssertionError("dropout: a gradient is not finite")
    name = f"causal, dropout {rate}, T=S={t}"
    lines = [f"  {'forward+backward, H=8 D=64':<34} {'attncomp':>10} {'peer':>10} {'ratio':>7}"]
    mine, other, ratio = paired(ours, theirs, repeats)
    lines.append(f"  {name + ' vs SDPA':<34} {mine * 1e3:8.1f}ms {other * 1e3:8.1f}ms {ratio:7.2f}")
    mine, other, ratio = paired(ours, without, repeats)
    lines.append(f"  {name + ' vs none':<34} {mine * 1e3:8.1f}ms {other * 1e3:8.1f}ms {ratio:7.2f}")
    return lines


def sdpa_rows(quick: bool, repeats: int) -> list[str]:
    """``attncomp.sdpa.scaled_dot_product_attention`` against PyTorch's, the same call: causal, a
    boolean mask of four causal documents, and a training step with dropout."""
    torch = peers.torch_or_none()
    if torch is None:
        return ["  sdpa: torch is absent, nothing to compare with"]
    from attncomp.sdpa import scaled_dot_product_attention as ours

    theirs = torch.nn.functional.scaled_dot_product_attention
    t = 512 if quick else 2048
    q, k, v = (torch.from_numpy(x) for x in inputs(np.random.default_rng(6), 1, 8, t, t, 64))
    i, j = torch.arange(t)[:, None], torch.arange(t)[None]
    documents = ((i // (t // 4)) == (j // (t // 4))) & (j <= i)
    trained = [x.clone().requires_grad_() for x in (q, k, v)]
    d_out = torch.randn_like(q)

    def step(fn):
        def run():
            for x in trained:
                x.grad = None
            fn(*trained, is_causal=True, dropout_p=0.1).backward(d_out)

        return run

    cases = [
        ("causal forward", lambda fn: lambda: fn(q, k, v, is_causal=True)),
        ("4 documents, [T, T] bool mask, forward", lambda fn: lambda: fn(q, k, v, attn_mask=documents)),
        ("causal fwd+bwd, dropout_p 0.1", step),
    ]
    lines = [f"  {f'scaled_dot_product_attention, T=S={t}':<42} {'attncomp':>10} {'torch':>10} {'ratio':>7}"]
    with torch.no_grad():
        for name, make in cases[:2]:
            check(name, make(ours)().numpy(), make(theirs)().numpy())
            mine, other, ratio = paired(make(ours), make(theirs), repeats)
            lines.append(f"  {name:<42} {mine * 1e3:8.1f}ms {other * 1e3:8.1f}ms {ratio:7.2f}")
    name, make = cases[2]
    mine, other, ratio = paired(make(ours), make(theirs), repeats)
    lines.append(f"  {name:<42} {mine * 1e3:8.1f}ms {other * 1e3:8.1f}ms {ratio:7.2f}")
    return lines


# decoding with the kv cache -------------------------------------------------------------
def copy_bandwidth() -> float:
    """Bytes per second of a large array copy (read + write), the machine's practical ceiling."""
    src = np.ones(128 * 2**20 // 4, dtype=np.float32)
    dst = np.empty_like(src)
    seconds = best_of(lambda: np.copyto(dst, src), 5)
    return 2 * src.nbytes / seconds


def decode_step_rows(quick: bool, repeats: int) -> list[str]:
    """(a) one decoder step over a 4096-token GQA cache, against torch and the bandwidth."""
    cache = 1024 if quick else 4096
    rng = np.random.default_rng(1)
    q, k, v = inputs(rng, 1, 32, cache, cache, 128, kv=8)
    dec = ac.compile(specs.gqa_decode, backend="cpu").decoder(max_len=cache)
    dec(q[:, :, :-1], k[:, :, :-1], v[:, :, :-1])  # prefill all but the last token

    def step():
        dec.length = cache - 1  # the same step again: append the last token, attend over all
        return dec(q[:, :, -1:], k[:, :, -1:], v[:, :, -1:])

    seconds = best_of(step, repeats * 5)
    cached = dec.cache
    read = cached["k_cache"].nbytes + cached["v_cache"].nbytes
    bandwidth = copy_bandwidth()
    lines = [
        f"  decode step, GQA 32/8 heads D=128, {cache} cached: {seconds * 1e3:.2f} ms, "
        f"{read / seconds / 1e9:.1f} GB/s = {read / seconds / bandwidth:.0%} of a large copy "
        f"({bandwidth / 1e9:.1f} GB/s)"
    ]
    torch = peers.torch_or_none()
    if torch is not None:
        kc, vc = cached["k_cache"], cached["v_cache"]
        last = q[:, :, -1:]
        check("decode step", step(), peers.torch_attention(torch, last, kc, vc, gqa=True))
        t = best_of(lambda: peers.torch_attention(torch, last, kc, vc, gqa=True), repeats * 5)
        lines.append(f"    torch SDPA over the same cache: {t * 1e3:.2f} ms, ratio {seconds / t:.2f}")
    return lines


def generation_rows(quick: bool) -> list[str]:
    """(b) generating tokens with the decoder against recomputing the whole prefix each step."""
    import importlib.util

    path = os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "nanochat_attention.py"
    )
    loader = importlib.util.spec_from_file_location("nanochat_attention", path)
    module = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(module)
    steps = 256 if quick else 1024
    rng = np.random.default_rng(2)
    x, *weights = module.make_inputs(rng, B=1, T=steps, C=256, n_head=4, n_kv_head=2)
    fn = ac.compile(module.nanochat_attention, backend="cpu", n_head=4, n_kv_head=2)
    dec = fn.decoder(max_len=steps)
    dec(x[:, :1], *weights)
    fn(x[:, :2], *weights)  # compile both before timing
    dec.reset()
    step_times = []
    start = time.perf_counter()
    for t in range(steps):
        s0 = time.perf_counter()
        dec(x[:, t : t + 1], *weights)
        step_times.append(time.perf_counter() - s0)
    cached = time.perf_counter() - start
    start = time.perf_counter()
    for t in range(steps):
        fn(x[:, : t + 1], *weights)[:, -1:]
    recompute = time.perf_counter() - start
    quarter = np.median(step_times[steps // 4 - 16 : steps // 4 + 16])
    full = np.median(step_times[-32:])
    return [
        f"  generating {steps} tokens (nanochat layer, C=256, 4/2 heads): decoder {cached:.2f} s, "
        f"recomputing the prefix {recompute:.2f} s, speed-up {recompute / cached:.1f}x",
        f"    median step at {steps // 4} cached: {quarter * 1e3:.3f} ms, at {steps}: {full * 1e3:.3f} ms "
        f"(x{full / quarter:.2f} for 4x the length: linear would be <= 4, quadratic 16)",
    ]


# peak memory and compile time run in fresh processes -----------------------------------
MEMORY_PROBE = r"""
import json, os, sys, threading, time
import numpy as np
T = int(sys.argv[1]); who = sys.argv[2]
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
rng = np.random.default_rng(0)
small = [rng.standard_normal((1, 8, 64, 64), dtype=np.float32) for _ in range(3)]
if who == "attncomp":
    import attncomp as ac
    from benchmarks import specs
    fn = ac.compile(specs.causal, backend="cpu"); fn(*small)
    call = lambda q, k, v: fn(q, k, v)
else:
    import torch; torch.set_num_threads(2)
    def call(q, k, v):
        with torch.no_grad():
            return torch.nn.functional.scaled_dot_product_attention(
                torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v), is_causal=True)
    call(*small)
q, k, v = (rng.standard_normal((1, 8, T, 64), dtype=np.float32) for _ in range(3))
before = rss(); peak = [before]; done = []
def sample():
    while not done:
        peak[0] = max(peak[0], rss()); time.sleep(0.001)
thread = threading.Thread(target=sample); thread.start()
out = call(q, k, v); done.append(1); thread.join()
peak[0] = max(peak[0], rss())
print(json.dumps({"growth": peak[0] - before, "io": 4 * q.nbytes}))
"""

COMPILE_PROBE = r"""
import json, sys, time
start = time.perf_counter()
import numpy as np
import attncomp as ac
from benchmarks import specs
imported = time.perf_counter()
x = np.ones((1, 2, 100, 64), dtype=np.float32)
fn = ac.compile(specs.causal, backend="cpu")
fn(x, x, x)
print(json.dumps({"import": imported - start, "first_call": time.perf_counter() - imported}))
"""


def run_probe(code: str, *args: str, env: dict[str, str] | None = None) -> dict:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        cwd=root,
        env={**os.environ, **(env or {})},
        check=True,
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


BACKWARD_MEMORY_PROBE = r"""
import json, os, sys, threading, time
import numpy as np
T = int(sys.argv[1])
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
import attncomp as ac
from benchmarks import specs
rng = np.random.default_rng(0)
small = [rng.standard_normal((1, 8, 64, 64), dtype=np.float32) for _ in range(4)]
fn = ac.compile(specs.causal, backend="cpu"); fn.vjp(*small[:3])[1](small[3])
q, k, v, d_out = (rng.standard_normal((1, 8, T, 64), dtype=np.float32) for _ in range(4))
out, pullback = fn.vjp(q, k, v)
before = rss(); peak = [before]; done = []
def sample():
    while not done:
        peak[0] = max(peak[0], rss()); time.sleep(0.001)
thread = threading.Thread(target=sample); thread.start()
grads = pullback(d_out); done.append(1); thread.join()
peak[0] = max(peak[0], rss())
print(json.dumps({"growth": peak[0] - before, "io": 8 * q.nbytes}))
"""


TORCH_STEP_MEMORY_PROBE = r"""
import json, os, sys, threading, time
import numpy as np
import torch
torch.set_num_threads(2)
T = int(sys.argv[1]); who = sys.argv[2]
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
if who == "attncomp":
    import attncomp as ac
    from benchmarks import specs
    attention = ac.compile(specs.causal, backend="cpu").to_torch()
else:
    def attention(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
def step(t):
    q, k, v = (torch.randn(1, 8, t, 64, requires_grad=True) for _ in range(3))
    attention(q, k, v).square().sum().backward()
    return q, k, v
step(64)
q, k, v = (torch.randn(1, 8, T, 64, requires_grad=True) for _ in range(3))
before = rss(); peak = [before]; done = []
def sample():
    while not done:
        peak[0] = max(peak[0], rss()); time.sleep(0.001)
thread = threading.Thread(target=sample); thread.start()
attention(q, k, v).square().sum().backward(); done.append(1); thread.join()
peak[0] = max(peak[0], rss())
print(json.dumps({"growth": peak[0] - before, "scores": 4 * 8 * T * T}))
"""


def torch_step_memory_rows(t: int = 2048) -> list[str]:
    """Peak memory of one training step through fn.to_torch() against torch SDPA's."""
    if peers.torch_or_none() is None:
        return []
    lines = []
    for who in ("attncomp", "torch"):
        probe = run_probe(TORCH_STEP_MEMORY_PROBE, str(t), who)
        lines.append(
            f"  peak memory of a training step through torch, causal T=S={t} H=8 D=64, {who:<8}: "
            f"{probe['growth'] / 2**20:7.1f} MiB (one T x S float32 score array: {probe['scores'] / 2**20:.0f} MiB)"
        )
    return lines


def memory_rows(quick: bool) -> list[str]:
    t = 2048 if quick else 16384
    lines = []
    for who in ("attncomp", "torch"):
        if who == "torch" and peers.torch_or_none() is None:
            continue
        probe = run_probe(MEMORY_PROBE, str(t), who)
        lines.append(
            f"  peak memory, causal T=S={t} H=8 D=64, {who:<8}: {probe['growth'] / 2**20:8.1f} MiB growth, "
            f"{probe['growth'] / probe['io']:.2f}x the inputs+output ({probe['io'] / 2**20:.0f} MiB)"
        )
    probe = run_probe(BACKWARD_MEMORY_PROBE, str(t))
    lines.append(
        f"  peak memory of the backward (pullback), causal T=S={t}: {probe['growth'] / 2**20:8.1f} MiB growth, "
        f"{probe['growth'] / probe['io']:.2f}x q, k, v, out, d_out and the three gradients "
        f"({probe['io'] / 2**20:.0f} MiB)"
    )
    return lines + torch_step_memory_rows()


def compile_rows() -> list[str]:
    """A new process's first result: with every cache empty (a fresh install: Numba's cache of
    the shared tile code too), for a new spec (the shared code cached), and with the spec cached."""
    with tempfile.TemporaryDirectory() as cache, tempfile.TemporaryDirectory() as numba_cache:
        fresh = run_probe(COMPILE_PROBE, env={"ATTNCOMP_CACHE_DIR": cache, "NUMBA_CACHE_DIR": numba_cache})
    with tempfile.TemporaryDirectory() as cache:
        run_probe(COMPILE_PROBE, env={"ATTNCOMP_CACHE_DIR": cache})  # the shared tile code cached, if not yet
    with tempfile.TemporaryDirectory() as cache:
        cold = run_probe(COMPILE_PROBE, env={"ATTNCOMP_CACHE_DIR": cache})
        warm = run_probe(COMPILE_PROBE, env={"ATTNCOMP_CACHE_DIR": cache})
    rows = [("every cache empty", fresh), ("a new spec", cold), ("warm cache", warm)]
    return [
        f"  compile, {label + ':':19s}{r['first_call']:6.2f} s to the first result (import {r['import']:.2f} s)"
        for label, r in rows
    ]


def sgemm_peak() -> float:
    """GFLOP/s of a 4096^3 float32 ``np.matmul`` (numpy's BLAS, every core): the machine's peak."""
    a = np.random.default_rng(1).standard_normal((4096, 4096), dtype=np.float32)
    a @ a
    return 2 * 4096**3 / best_of(lambda: a @ a, 3) / 1e9


def print_table(rows: list[Row]) -> None:
    peak = sgemm_peak()
    print(f"{'case':<42} {'attncomp':>10} {'torch':>10} {'numpy':>10} {'vs torch':>9} {'vs numpy':>9}  GFLOP/s")
    for row in rows:
        s = row.seconds
        cells = [f"{s[k] * 1e3:9.1f}ms" if s.get(k) else f"{'-':>10}" for k in ("attncomp", "torch", "numpy")]
        ratios = [f"{s['attncomp'] / s[k]:9.2f}" if s.get(k) else f"{'-':>9}" for k in ("torch", "numpy")]
        if row.torch_ratio is not None:
            ratios[0] = f"{row.torch_ratio:9.2f}"
        rates = f"{row.flops / s['attncomp'] / 1e9:6.0f}"
        if s.get("torch"):
            rates += f" (torch {row.flops / s['torch'] / 1e9:.0f})"
        print(f"{row.case:<42} {' '.join(cells)} {' '.join(ratios)}  {rates}")
    print(f"  sgemm peak: a 4096^3 float32 np.matmul runs at {peak:.0f} GFLOP/s on this machine")


def plot(rows: list[Row], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install 'attncomp[plot]'") from None
    peers_ = ["attncomp", "torch", "numpy"]
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.27
    for n, who in enumerate(peers_):
        values = [(r.seconds.get(who) or 0) * 1e3 for r in rows]
        ax.bar([x + n * width for x in range(len(rows))], values, width, label=who)
    ax.set_xticks([x + width for x in range(len(rows))], [r.case for r in rows], rotation=20, ha="right")
    ax.set_ylabel("ms (lower is better)")
    ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller sizes")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--plot", metavar="PNG")
    parser.add_argument("--skip-processes", action="store_true", help="skip the memory and compile probes")
    parser.add_argument("--serving-only", action="store_true", help="only the paged decoder's rows")
    parser.add_argument("--flex-only", action="store_true", help="only attncomp.flex's rows")
    parser.add_argument("--flash-attn-only", action="store_true", help="only attncomp.flash_attn's rows")
    results_file.add_option(parser)
    args = parser.parse_args(argv)
    with results_file.recorded(args, "benchmarks.cpu", argv):
        torch = peers.torch_or_none()
        print(
            f"attncomp {ac.__version__}, numpy {np.__version__}, torch {torch.__version__ if torch else 'absent'}, "
            f"threads {os.environ['NUMBA_NUM_THREADS']}, float32"
        )
        print(peers.blas_kernels())
        only = {"serving_only": serving_rows, "flex_only": flex_rows, "flash_attn_only": flash_attn_rows}
        chosen = [rows for name, rows in only.items() if getattr(args, name)]
        if chosen:
            for line in chosen[0](args.quick, args.repeats):
                print(line)
            return
        rows = attention_cases(args.quick, args.repeats)
        print_table(rows)
        for line in backward_rows(args.quick, args.repeats) + dropout_rows(args.quick, args.repeats):
            print(line)
        for line in sdpa_rows(args.quick, args.repeats) + flex_rows(args.quick, args.repeats):
            print(line)
        for line in flash_attn_rows(args.quick, args.repeats):
            print(line)
        for line in decode_step_rows(args.quick, args.repeats) + generation_rows(args.quick):
            print(line)
        for line in float_type_rows(args.quick, args.repeats):
            print(line)
        for line in call_overhead.rows(200 if args.quick else 2000):
            print(line)
        for line in serving_rows(args.quick, args.repeats):
            print(line)
        from benchmarks import hf_model  # a Hugging Face model's training step (the hf extra)

        for line in hf_model.rows(args.quick, args.repeats) + hf_model.dropout_rows(args.quick, args.repeats):
            print(line)
        for line in hf_model.t5_rows(args.quick, args.repeats):
            print(line)
        if not args.skip_processes:
            for line in memory_rows(args.quick) + compile_rows():
                print(line)
        if args.plot:
            plot(rows, args.plot)


if __name__ == "__main__":
    main()
