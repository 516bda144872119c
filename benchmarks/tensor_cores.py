"""GPU benchmark: the forward on tensor cores (f16/bf16, and float32 as 3xTF32 or TF32) against
PyTorch SDPA, in one table.

    python -m benchmarks.tensor_cores            # the rows of the tensor-core targets
    python -m benchmarks.tensor_cores --quick    # smaller sizes, for a smoke run

    python -m benchmarks.tensor_cores --compile-only   # one untimed call per row: fills the kernel cache

(also printed by ``python -m benchmarks.gpu``).  Each row calls attncomp's torch op
(``fn.to_torch()`` of a generic spec, so the call's dtype picks the kernel) and the peer
alternately, CUDA-event timed, and reports the median of the per-pair ratios (below 1.0
attncomp is faster).  The peers: SDPA restricted to its flash backend (FlashAttention-2, on
the same ``mma.sync`` instructions), and SDPA's own choice, named (cuDNN, flash, efficient,
math); the window row's peer is SDPA with a boolean mask, as FlexAttention-less PyTorch has
it; float32 rows' peer is SDPA's efficient backend (its float32 kernel), and they run three
ways: ``precision=exact`` (3xTF32, the default), ``precision=tf32`` (opt-in) and
``precision=ieee`` (float32 FMAs), so the two exact paths are measured side by side.
TFLOP/s count 4 B H D per (query, key) pair computed: all pairs dense, the visible ones
causal.  The sigmoid row (sigmoid attention, ``examples/sigmoid_attention.py``) is checked against
PyTorch's eager sigmoid attention (its "default" column) and timed against FlashAttention-2's
softmax attention at the same size, as FlashSigmoid is.  Without a GPU it says so and exits with
status 0.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from dataclasses import dataclass, field

import attncomp as ac
from benchmarks import specs

#: a dense-FLOP peak of the card, for the "% of peak" column (H100 SXM: 989 TFLOP/s f16/bf16)
PEAKS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}


@dataclass
class Row:
    name: str
    dtype: str  # "bfloat16", "float16" or "float32"
    spec: ac.Spec
    b: int
    h: int
    t: int
    d: int
    causal: bool
    window: int | None = None
    constants: dict = field(default_factory=dict)
    precision: str | None = None  # flash-tiling's option (None: the default pipeline)
    peer: str = "flash"  # the SDPA backend compared with: "flash" or "efficient"
    tolerance: float = 5e-2  # largest error relative to SDPA's largest output
    deterministic: bool = False  # ``ac.compile(..., deterministic=True)``: a backward without atomics
    alibi: bool = False  # the spec takes ALiBi slopes [H] (in the row's type, their gradient taken)
    dropout: float = 0.0  # attention dropout's rate (the spec takes a seed [1] and the constant ``rate``)
    sigmoid: bool = False  # sigmoid attention: checked against PyTorch's eager one, timed against the peer's softmax

    def pipeline(self) -> str | None:
        if self.precision is None:
            return None
        return f"cse,softmax-fusion,flash-tiling{{precision={self.precision}}},mask-elimination,canonicalize,cse,dce"

    def pairs(self) -> float:
        t = self.t
        if self.window is not None:
            return sum(min(i + 1, self.window) for i in range(t))
        return t * (t + 1) / 2 if self.causal else t * t

    def flops(self) -> float:
        return 4.0 * self.b * self.h * self.d * self.pairs()

    def bytes(self, arrays: int = 4) -> float:
        """The least memory traffic of a call: ``arrays`` arrays of [B, H, T, D] (forward: q, k, v and
        the output) each read or written once."""
        itemsize = 4 if self.dtype == "float32" else 2
        return float(arrays * self.b * self.h * self.t * self.d * itemsize)


@dataclass
class Timing:
    """One row measured: attncomp's median ms, the peer's and SDPA's default choice's, and the medians
    of the per-pair ratios (below 1.0 attncomp is faster)."""

    row: Row
    ms: float
    peer: str
    peer_ms: float
    ratio: float
    default: str
    default_ms: float
    default_ratio: float
    flops: float  # floating-point operations of one call (the table's count)
    bytes: float  # the least memory traffic of one call
    kernel: str = ""  # the attention kernels the calls ran (``kernels_run``)

    @property
    def tflops(self) -> float:
        return self.flops / (self.ms * 1e-3) / 1e12

    @property
    def gbps(self) -> float:
        return self.bytes / (self.ms * 1e-3) / 1e9

    def line(self) -> str:
        return (
            f"{self.row.name:40s} {self.ms:9.3f} {self.tflops:7.1f} {self.peer:>9s} {self.peer_ms:9.3f} "
            f"{self.ratio:6.2f} {self.default:>9s} {self.default_ms:9.3f} {self.default_ratio:6.2f} {self.kernel}"
        )


def rows(quick: bool) -> list[Row]:
    def float32(t: int, b: int) -> list[Row]:
        return [
            Row(
                f"f32 {p} causal T=S={t} D=64 B={b} H=16",
                "float32",
                specs.causal_any,
                b,
                16,
                t,
                64,
                True,
                precision=p,
                peer="efficient",
                tolerance=5e-3 if p == "tf32" else 1e-4,
            )
            for p in ("exact", "tf32", "ieee")
        ]

    if quick:
        return [
            Row("bf16 causal T=S=2048 D=128 B=1 H=16", "bfloat16", specs.causal_any, 1, 16, 2048, 128, True),
            Row("f16 dense T=S=1024 D=64 B=2 H=8", "float16", specs.dense_any, 2, 8, 1024, 64, False),
            *float32(1024, 1),
        ]
    window = {"window": 256}
    return [
        *float32(16384, 1),
        Row("bf16 causal T=S=16384 D=128 B=1 H=16", "bfloat16", specs.causal_any, 1, 16, 16384, 128, True),
        Row("bf16 causal T=S=4096 D=64 B=4 H=16", "bfloat16", specs.causal_any, 4, 16, 4096, 64, True),
        Row("f16 dense T=S=4096 D=128 B=4 H=16", "float16", specs.dense_any, 4, 16, 4096, 128, False),
        Row(
            "bf16 window 256 T=S=8192 D=128 B=1 H=16",
            "bfloat16",
            specs.causal_window_any,
            1,
            16,
            8192,
            128,
            True,
            256,
            window,
        ),
        Row(
            "bf16 sigmoid causal T=S=4096 D=64 B=4 H=16",
            "bfloat16",
            specs.causal_sigmoid_any,
            4,
            16,
            4096,
            64,
            True,
            sigmoid=True,
        ),
    ]


def sdpa_choice(torch, q, k, v, causal: bool, mask, dropout: float = 0.0) -> str:
    """The SDPA backend PyTorch picks for these inputs (its dispatcher's answer), or "unknown"."""
    try:
        from torch.nn.attention import SDPBackend

        choice = torch._fused_sdp_choice(q, k, v, mask, dropout, causal and mask is None)
        return SDPBackend(choice).name.lower()
    except Exception:  # a private function: absent or changed in this torch
        return "unknown"


def paired_ms(torch, ours, theirs, repeats: int) -> tuple[float, float, float]:
    """Median ms of each, called alternately, and the median of the per-pair ratios."""
    ours(), theirs()
    torch.cuda.synchronize()
    mine, peer, ratios = [], [], []
    for _ in range(repeats):
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        marks[0].record()
        ours()
        marks[1].record()
        theirs()
        marks[2].record()
        marks[2].synchronize()
        a, b = marks[0].elapsed_time(marks[1]), marks[1].elapsed_time(marks[2])
        mine.append(a)
        peer.append(b)
        ratios.append(a / b)
    return statistics.median(mine), statistics.median(peer), statistics.median(ratios)


def window_mask(torch, row: Row):
    """The boolean mask SDPA takes for a window row (True: attended), or None."""
    if row.window is None:
        return None
    i = torch.arange(row.t, device="cuda")[:, None]
    j = torch.arange(row.t, device="cuda")[None, :]
    return (j <= i) & (i - j < row.window)


def run_row(torch, row: Row, repeats: int) -> str:
    return measure_row(torch, row, repeats).line()


def warm_row(torch, row: Row) -> None:
    """One call of attncomp's op at the row's size, untimed: its kernels compile (and are cached on disk)."""
    dtype = getattr(torch, row.dtype)
    q, k, v = (torch.randn((row.b, row.h, row.t, row.d), device="cuda", dtype=dtype) for _ in range(3))
    fn = ac.compile(row.spec, backend="cuda", pipeline=row.pipeline(), **row.constants)
    attn = fn.to_torch()
    attn(q, k, v)
    torch.cuda.synchronize()


def kernels_run(fn) -> str:
    """The attention kernels ``fn``'s last call ran, by their choice: "mma async" (``cp.async`` and
    ``ldmatrix``), "mma staged" (loads and stores), "fma" (the scalar kernels)."""
    names = []
    for group in getattr(fn.compilation.program, "attention", []):
        choice = group.last_choice
        if choice is not None:
            names.append("fma" if choice.atom is None else "mma async" if choice.async_copies else "mma staged")
    return ",".join(dict.fromkeys(names)) or "-"


def measure_row(torch, row: Row, repeats: int) -> Timing:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dtype = getattr(torch, row.dtype)
    generator = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (
        torch.randn((row.b, row.h, row.t, row.d), device="cuda", dtype=dtype, generator=generator) for _ in range(3)
    )
    fn = ac.compile(row.spec, backend="cuda", pipeline=row.pipeline(), **row.constants)
    attn = fn.to_torch()
    mask = window_mask(torch, row)

    def ours():
        return attn(q, k, v)

    def sdpa():
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=row.causal and mask is None
        )

    def flash():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return sdpa()

    def efficient():
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            return sdpa()

    def eager_sigmoid():
        scores = q @ k.transpose(-1, -2) * row.d**-0.5 - math.log(row.t)
        causal = torch.ones(row.t, row.t, dtype=torch.bool, device="cuda").tril()
        return torch.where(causal, torch.sigmoid(scores), 0.0).to(q.dtype) @ v

    want = eager_sigmoid() if row.sigmoid else sdpa()
    error = float((ours().float() - want.float()).abs().max() / want.float().abs().max())
    if error > row.tolerance:
        raise AssertionError(f"{row.name}: attncomp differs from torch by {error:.2e}")
    if mask is not None:
        peer, peer_name = sdpa, "sdpa+mask"
    else:
        peer, peer_name = (flash, "flash") if row.peer == "flash" else (efficient, "efficient")
    mine, theirs, ratio = paired_ms(torch, ours, peer, repeats)
    _, default, default_ratio = paired_ms(torch, ours, eager_sigmoid if row.sigmoid else sdpa, repeats)
    choice = "eager" if row.sigmoid else sdpa_choice(torch, q, k, v, row.causal, mask)
    timing = Timing(row, mine, peer_name, theirs, ratio, choice, default, default_ratio, row.flops(), row.bytes())
    timing.kernel = kernels_run(fn)
    return timing


def table(torch, title: str, rows: list[Row], run, repeats: int) -> list[str]:
    """The lines of a table: ``title`` (``{name}``: the card, ``{peak}``: its dense peak), the
    header, and ``run(torch, row, repeats)`` for each row."""
    name = torch.cuda.get_device_name()
    peak = next((p for card, p in PEAKS.items() if card in name), None)
    lines = [
        title.format(name=name, peak=peak or "?"),
        f"{'case':40s} {'ours ms':>9s} {'TFLOP/s':>7s} {'peer':>9s} {'peer ms':>9s} {'ratio':>6s} "
        f"{'default':>9s} {'dflt ms':>9s} {'ratio':>6s}",
    ]
    for row in rows:
        lines.append(run(torch, row, repeats))
        torch.cuda.empty_cache()
    return lines


def tensor_core_rows(torch, quick: bool, repeats: int) -> list[str]:
    title = "forward on tensor cores ({name}; peak {peak} TFLOP/s dense f16/bf16, half that TF32)"
    return table(torch, title, rows(quick), run_row, repeats)


def main_of(program: str, doc: str, table_rows, argv: list[str] | None, rows_of=None, warm=None) -> int:
    """A table's command line: ``--quick`` and ``--repeats``; ``table_rows(torch, quick, repeats)``
    printed, or why nothing could be timed.  ``--compile-only`` calls ``warm(torch, row)`` for each of
    ``rows_of(quick)`` instead: one untimed call a row, which fills the kernel cache."""
    from benchmarks.gpu import gpu_or_reason

    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke run")
    parser.add_argument("--repeats", type=int, default=10)
    if warm is not None:
        parser.add_argument(
            "--compile-only", action="store_true", help="call each row once, untimed (compiles its kernels)"
        )
    args = parser.parse_args(argv)
    reason = gpu_or_reason()
    if reason is not None:
        print(f"{program}: nothing to time: {reason}.")
        return 0
    import torch

    if getattr(args, "compile_only", False):
        for row in rows_of(args.quick):
            warm(torch, row)
            print(f"compiled: {row.name}")
        return 0
    for line in table_rows(torch, args.quick, args.repeats):
        print(line)
    return 0


def main(argv: list[str] | None = None) -> int:
    return main_of("benchmarks.tensor_cores", __doc__, tensor_core_rows, argv, rows, warm_row)


if __name__ == "__main__":
    sys.exit(main())
