"""Command line of the instruction report (see the package's docstring)."""

from __future__ import annotations

import argparse
import json
import sys
import time

from benchmarks.kernel_report import assemble
from benchmarks.kernel_report.kernels import DEFAULT, Case, build
from benchmarks.kernel_report.report import HEADER, KernelReport, detail, measure, row, summary

ARCHS = {"sm_80": (8, 0), "sm_90": (9, 0)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.kernel_report",
        description="Registers, occupancy and SASS instruction counts of the tensor-core kernels, offline.",
    )
    parser.add_argument("--spec", help="a spec of benchmarks/specs.py (default: the default kernels)")
    parser.add_argument("--dtype", choices=["bf16", "f16", "f32"], help="float type (default bf16)")
    parser.add_argument("--head-dim", type=int, nargs="+", help="head dims D = E (default 64)")
    parser.add_argument("--backward", action="store_true", help="the backward's kernels")
    parser.add_argument(
        "--group", type=int, default=0, help="a decode step's kernel: one row a head, GROUP heads a key/value head"
    )
    parser.add_argument("--pipeline", help="the pipeline text (default: the cuda backend's default pipeline)")
    parser.add_argument("--arch", choices=sorted(ARCHS), nargs="+", default=["sm_90"], help="targets")
    parser.add_argument("--json", metavar="FILE", help="also write the reports to FILE as JSON")
    return parser.parse_args(argv)


def cases(args: argparse.Namespace) -> list[Case]:
    """The default kernels, or the ones the options name."""
    if args.spec is None and args.dtype is None and args.head_dim is None and not args.backward and not args.group:
        return list(DEFAULT)
    spec, dtype = args.spec or ("gqa_decode_any" if args.group else "causal_any"), args.dtype or "bf16"
    return [Case(spec, dtype, d, args.backward, args.group) for d in args.head_dim or [64]]


def run(chosen: list[Case], archs: list[str], pipeline: str | None = None, log=None) -> list[KernelReport]:
    """Build, compile, assemble and count each case's kernels for each target."""
    from attncomp.backends.numba_cuda.ptx import compile_ptx_for

    reports = []
    targets = [ARCHS[a] for a in archs]
    for case in chosen:
        for built in build(case, pipeline):
            start = time.perf_counter()
            kernel = built.kernel
            ptxs = compile_ptx_for(kernel.py_func, kernel.signature, targets, kernel.launch_bounds)
            for cc in targets:
                reports.append(measure(built, ptxs[cc], cc))
            if log is not None:
                print(f"  {case.label}: {kernel.name} ({time.perf_counter() - start:.0f} s)", file=log, flush=True)
    return reports


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    missing = assemble.toolchain_missing()
    if missing is not None:
        print(f"kernel_report: {missing}", file=sys.stderr)
        return 1
    print("compiling (Numba front end and NVVM take tens of seconds a kernel) ...", file=sys.stderr, flush=True)
    reports = run(cases(args), args.arch, args.pipeline, log=sys.stderr)
    print("Offline SASS counts (nvJitLink + nvdisasm); static counts, not GPU timings.")
    print("blk/SM: resident blocks per SM and the resource that limits them; loop: the main loop's body.\n")
    print(HEADER)
    for report in reports:
        print(row(report))
    for report in reports:
        print()
        print(detail(report))
    line = summary(reports)
    if line is not None:
        print()
        print(line)
    if args.json:
        with open(args.json, "w") as out:
            json.dump([r.to_json() for r in reports], out, indent=2)
    return 0
