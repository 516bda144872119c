"""GPU benchmark: attncomp's fused CUDA kernels against PyTorch SDPA, float32, in one table.

    python -m benchmarks.gpu             # the full table
    python -m benchmarks.gpu --quick     # smaller sizes, for a smoke run

Cases: float32 dense and causal attention at T = S = 4096 and 16384 with D = 64 and
128, and one decoding step (T = 1) over a 32k-entry cache.  Then one step of
a decoder (``fn.decoder``, its cache on the GPU) with grouped-query heads
32/8, D = 128 and 4096 cached tokens, against torch SDPA (``enable_gqa``)
over the same cache and against a device-to-device copy's bandwidth.  Then training steps:
forward+backward through ``fn.to_torch()`` against SDPA's forward+backward (causal at
T = 2048, 8192 and 16384, H = 8, D = 64, and a causal window of 256 keys at T = 8192 against
SDPA with a boolean mask), then the same steps in bf16 (and float32) on tensor cores
(``benchmarks.tensor_core_training``: against SDPA's flash backend and its default choice).  Inputs are torch
CUDA tensors, passed to attncomp as device arrays (``__cuda_array_interface__``),
so no copy is timed.  Each time is the median of CUDA-event-timed calls after
a warm-up call (which compiles).  Then the f16/bf16 rows on tensor cores
(``benchmarks.tensor_cores``: against SDPA's flash backend and its default choice).  Last, the
serving rows of ``benchmarks.serving`` with
the paged decoder's pool on the GPU (steps take host arrays: their times, paired wall
clock, include the new tokens' copies).  Printed: milliseconds, achieved TFLOP/s
(4 B H T S D for dense, half the pairs for causal), GB/s of q, k, v and the
output, and attncomp's time over torch's (below 1.0 attncomp is faster).
PyTorch's float32 SDPA uses no TF32 unless asked (``allow_tf32`` is left off).

Without a GPU (or without numba-cuda) it says so and exits with status 0.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass

import attncomp as ac
from benchmarks import serving, specs


@dataclass
class Case:
    name: str
    spec: ac.Spec
    b: int
    h: int
    t: int
    s: int
    d: int
    causal: bool

    def flops(self) -> float:
        pairs = self.t * self.s if not self.causal else self.t * (self.t + 1) / 2 + self.t * (self.s - self.t)
        return 4.0 * self.b * self.h * pairs * self.d

    def bytes(self) -> float:
        return 4.0 * self.b * self.h * self.d * (2 * self.t + 2 * self.s)


def cases(quick: bool) -> list[Case]:
    lengths = [1024] if quick else [4096, 16384]
    found = []
    for t in lengths:
        for d in (64, 128):
            b, h = (4, 16) if t <= 4096 else (1, 16)
            found.append(Case(f"dense T=S={t} D={d}", specs.dense, b, h, t, t, d, False))
            found.append(Case(f"causal T=S={t} D={d}", specs.causal, b, h, t, t, d, True))
    cache = 4096 if quick else 32768
    found.append(Case(f"decode T=1 cache={cache} D=128", specs.dense, 4, 32, 1, cache, 128, False))
    return found


def gpu_or_reason() -> str | None:
    try:
        from numba import cuda
    except ImportError:
        return "numba-cuda is not installed (pip install -e '.[cuda]')"
    try:
        if not cuda.is_available():
            return "no CUDA GPU is available"
    except Exception as error:  # a broken driver counts as no GPU
        return f"no usable CUDA GPU ({error})"
    try:
        import torch
    except ImportError:
        return "PyTorch is not installed (the peer this benchmark measures against)"
    if not torch.cuda.is_available():
        return "PyTorch was built without CUDA (install a CUDA build of torch)"
    return None


def compile_cuda(spec: ac.Spec):
    """``ac.compile(spec, backend="cuda")``, or the backend built directly while api.py lacks it."""
    from attncomp.backends import BACKENDS

    if "cuda" in BACKENDS:
        return ac.compile(spec, backend="cuda")
    from attncomp.backends import numba_cuda

    fn = ac.compile(spec, backend="interp")
    impl = numba_cuda.build(fn.module)
    return lambda *args: impl.call(fn.func, args, fn.constraints)


def median_ms(torch, call, repeats: int) -> float:
    call()  # warm-up: compiles, allocates
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def run_case(torch, case: Case, repeats: int) -> tuple[float, float, float]:
    generator = torch.Generator(device="cuda").manual_seed(0)

    def tensor(n):
        return torch.randn((case.b, case.h, n, case.d), device="cuda", dtype=torch.float32, generator=generator)

    q, k, v = tensor(case.t), tensor(case.s), tensor(case.s)
    fn = compile_cuda(case.spec)

    def ours():
        return fn(q, k, v)

    def theirs():
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=case.causal)

    got = torch.as_tensor(ours(), device="cuda")
    want = theirs()
    error = float((got - want).abs().max() / want.abs().max())
    if error > 1e-3:
        raise AssertionError(f"{case.name}: attncomp differs from torch by {error:.2e}")
    return median_ms(torch, ours, repeats), median_ms(torch, theirs, repeats), error


def decoder_step_case(torch, quick: bool, cache_type: str | None = None):
    """(step, decoder, q) of the decoder row: a GQA 32/8 D = 128 float32 decoder on the device, its
    cache prefilled with all but the last token; ``step()`` appends the last and attends over all.
    The cache holds twice the positions the step attends (``max_len``), as a decoder's does partway
    through a sequence: its views up to the length are not the whole cache.
    ``cache_type``: the decoder's ``cache=`` (an 8-bit cache), else float32."""
    cache = 1024 if quick else 4096
    generator = torch.Generator(device="cuda").manual_seed(1)

    def tensor(h):
        return torch.randn((1, h, cache, 128), device="cuda", dtype=torch.float32, generator=generator)

    q, k, v = tensor(32), tensor(8), tensor(8)
    dec = ac.compile(specs.gqa_decode, backend="cuda").decoder(max_len=2 * cache, cache=cache_type)
    dec(q[:, :, :-1], k[:, :, :-1], v[:, :, :-1])  # prefill all but the last token

    def step():
        dec.length = cache - 1  # the same step again: append the last token, attend over all
        return dec(q[:, :, -1:], k[:, :, -1:], v[:, :, -1:])

    return step, dec, q


def decoder_step_row(torch, quick: bool, repeats: int) -> str:
    """One decoder step over a GQA cache on the device (flash-decoding splits its keys)."""
    step, dec, q = decoder_step_case(torch, quick)
    cache = dec.max_len // 2
    got = torch.as_tensor(step(), device="cuda")
    kc, vc = (torch.as_tensor(a, device="cuda") for a in dec.cache.values())  # all `cache` entries, after the step
    last = q[:, :, -1:]

    def theirs():
        return torch.nn.functional.scaled_dot_product_attention(last, kc, vc, enable_gqa=True)

    error = float((got - theirs()).abs().max() / theirs().abs().max())
    if error > 1e-3:
        raise AssertionError(f"decoder step: attncomp differs from torch by {error:.2e}")
    ours, their_ms = median_ms(torch, step, repeats), median_ms(torch, theirs, repeats)
    big = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    copy_ms = median_ms(torch, lambda: big.clone(), repeats)
    copy_gbps = 2 * big.numel() / (copy_ms * 1e-3) / 1e9  # read + write
    read = kc.numel() * 4 * 2
    gbps = read / (ours * 1e-3) / 1e9
    from attncomp.backends.numba_cuda.host.launches import launch_count

    splits = dec.fn.program.attention[0].last_split
    before = launch_count()
    step()
    launches = launch_count() - before
    return (
        f"decoder step, GQA 32/8 D=128, {cache} cached: {ours:.3f} ms ({splits} key splits, {launches} launches), "
        f"{gbps:.0f} GB/s = "
        f"{gbps / copy_gbps:.0%} of a device copy ({copy_gbps:.0f} GB/s); torch {their_ms:.3f} ms, "
        f"ratio {ours / their_ms:.2f}"
    )


def fp8_decoder_step_row(torch, quick: bool, repeats: int) -> str:
    """The decoder row's step over an f8e4m3 cache against the same step over a float32 cache, and
    its result against SDPA's on the dequantised cache (float32's tolerance)."""
    from attncomp.backends.numba_cuda.host.arrays import device_view
    from attncomp.ir.quantized import dequantize

    step, dec, q = decoder_step_case(torch, quick, "f8e4m3")
    plain, base, _ = decoder_step_case(torch, quick)
    got = torch.as_tensor(step(), device="cuda")
    held = {name: x.copy_to_host() for name, x in dec.cache.items()}
    kc, vc = (torch.as_tensor(dequantize(held[f"{x}_cache"], held[f"{x}_scale"]), device="cuda") for x in ("k", "v"))
    want = torch.nn.functional.scaled_dot_product_attention(q[:, :, -1:], kc, vc, enable_gqa=True)
    error = float((got - want).abs().max() / want.abs().max())
    if error > 1e-3:
        raise AssertionError(
            f"f8e4m3 decoder step: attncomp differs from torch on the dequantised cache by {error:.2e}"
        )
    ours, float32_ms = median_ms(torch, step, repeats), median_ms(torch, plain, repeats)
    memory = sum(device_view(x).nbytes for x in dec.cache.values()) / sum(
        device_view(x).nbytes for x in base.cache.values()
    )
    return (
        f"f8e4m3 decoder step, GQA 32/8 D=128, {dec.max_len // 2} cached: {ours:.3f} ms; "
        f"float32 cache {float32_ms:.3f} ms, ratio {ours / float32_ms:.2f}; "
        f"cache bytes {memory:.3f} of float32's (scales included)"
    )


def bf16_decode_case(torch, quick: bool):
    """(op, q, k, v) of the bf16 decode row: ``fn.to_torch()`` of a GQA 32/8 D = 128 attention, one
    query row a head over 1,024 or 4,096 keys, bf16 CUDA tensors."""
    cache = 1024 if quick else 4096
    generator = torch.Generator(device="cuda").manual_seed(2)

    def tensor(h: int, n: int):
        return torch.randn((1, h, n, 128), device="cuda", generator=generator).bfloat16()

    q, k, v = tensor(32, 1), tensor(8, cache), tensor(8, cache)
    return ac.compile(specs.gqa_decode_any, backend="cuda").to_torch(), q, k, v


def bf16_decode_row(torch, quick: bool, repeats: int) -> str:
    """A bf16 decoding step's attention, GQA 32/8, D = 128, one query row a head over the cached keys,
    through ``fn.to_torch()``: the tensor-core kernel with each group's four heads packed into one
    tile (``mma/packed_heads.py``), against SDPA on the same tensors, alternated (median of the
    per-pair ratios)."""
    from benchmarks.tensor_cores import paired_ms

    op, q, k, v = bf16_decode_case(torch, quick)
    cache = k.shape[2]

    def ours():
        return op(q, k, v)

    def theirs():
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    want = theirs().float()
    error = float((ours().float() - want).abs().max() / want.abs().max())
    if error > 2e-2:
        raise AssertionError(f"bf16 decode step: attncomp differs from torch by {error:.2e}")
    mine, peer, ratio = paired_ms(torch, ours, theirs, repeats)
    gbps = 2 * k.numel() * k.element_size() / (mine * 1e-3) / 1e9
    return (
        f"bf16 decode step (torch op), GQA 32/8 D=128, {cache} cached, heads packed: {mine:.3f} ms, "
        f"{gbps:.0f} GB/s of keys and values; SDPA {peer:.3f} ms, ratio {ratio:.2f}"
    )


def training_rows(torch, quick: bool, repeats: int) -> list[str]:
    """Forward+backward through ``fn.to_torch()`` against SDPA's.

    No peak-memory column: attncomp's kernels allocate through Numba, which PyTorch's memory
    counters do not see (benchmarks.cpu measures the backward's memory).
    """
    lengths = [1024] if quick else [2048, 8192, 16384]
    cases = [(f"causal T=S={t}", specs.causal, {}, t, {"is_causal": True}, t * (t + 1) / 2) for t in lengths]
    t = 2048 if quick else 8192
    i, j = torch.arange(t, device="cuda")[:, None], torch.arange(t, device="cuda")[None, :]
    window = (j <= i) & (i - j < 256)
    cases.append(
        (f"causal window 256 T=S={t}", specs.causal_window, {"window": 256}, t, {"attn_mask": window}, t * 256)
    )
    lines = [
        f"{'forward+backward, B=1 H=8 D=64':34s} {'attncomp ms':>12s} {'torch ms':>10s} {'TFLOP/s':>8s} {'ratio':>7s}"
    ]
    generator = torch.Generator(device="cuda").manual_seed(2)
    for name, spec, constants, t, peer, pairs in cases:
        q, k, v, d_out = (torch.randn((1, 8, t, 64), device="cuda", generator=generator) for _ in range(4))
        for x in (q, k, v):
            x.requires_grad_()
        attn = ac.compile(spec, backend="cuda", **constants).to_torch()

        def ours(attn=attn, q=q, k=k, v=v, d_out=d_out):
            q.grad = k.grad = v.grad = None
            attn(q, k, v).backward(d_out)
            return q.grad

        def theirs(q=q, k=k, v=v, d_out=d_out, peer=peer):
            q.grad = k.grad = v.grad = None
            torch.nn.functional.scaled_dot_product_attention(q, k, v, **peer).backward(d_out)
            return q.grad

        got, want = ours().clone(), theirs()
        error = float((got - want).abs().max() / want.abs().max())
        if error > 1e-3:
            raise AssertionError(f"{name}: attncomp's dq differs from torch's by {error:.2e}")
        mine, other = median_ms(torch, ours, repeats), median_ms(torch, theirs, repeats)
        flops = 7 * 2 * pairs * 64 * 8  # 2 products forward, 5 backward
        lines.append(f"{name:34s} {mine:12.3f} {other:10.3f} {flops / (mine * 1e-3) / 1e12:8.2f} {mine / other:7.2f}")
        torch.cuda.empty_cache()
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke run")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument(
        "--only",
        choices=["forward", "tensor-cores", "decoder", "training", "serving"],
        help="run one part of the table (default: all)",
    )
    args = parser.parse_args(argv)
    reason = gpu_or_reason()
    if reason is not None:
        print(f"benchmarks.gpu: nothing to time: {reason}.")
        return 0
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    print(f"device: {torch.cuda.get_device_name()}  (float32, median of {args.repeats} calls)")
    if args.only in (None, "forward"):
        header = f"{'case':34s} {'attncomp ms':>12s} {'torch ms':>10s} {'TFLOP/s':>8s} {'GB/s':>8s} {'ratio':>7s}"
        print(header)
        print("-" * len(header))
        for case in cases(args.quick):
            ours, theirs, _ = run_case(torch, case, args.repeats)
            tflops = case.flops() / (ours * 1e-3) / 1e12
            gbps = case.bytes() / (ours * 1e-3) / 1e9
            print(f"{case.name:34s} {ours:12.3f} {theirs:10.3f} {tflops:8.2f} {gbps:8.1f} {ours / theirs:7.2f}")
            torch.cuda.empty_cache()
    if args.only in (None, "tensor-cores"):
        from benchmarks.tensor_cores import tensor_core_rows

        for line in tensor_core_rows(torch, args.quick, args.repeats):
            print(line)
    if args.only in (None, "decoder"):
        print(decoder_step_row(torch, args.quick, args.repeats))
        print(bf16_decode_row(torch, args.quick, args.repeats))
    if args.only in (None, "training"):
        from benchmarks.tensor_core_training import training_rows as tensor_core_training_rows

        for line in training_rows(torch, args.quick, args.repeats):
            print(line)
        for line in tensor_core_training_rows(torch, args.quick, args.repeats):
            print(line)
    if args.only in (None, "serving"):
        for line in serving.serving_rows(args.quick, args.repeats, backend="cuda"):
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
