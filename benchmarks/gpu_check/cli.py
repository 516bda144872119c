"""The command line: ``python -m benchmarks.gpu_check OUT_DIR`` runs the phases and writes the
summary; ``--worker KIND`` (internal) runs one worker inside a phase's subprocess."""

from __future__ import annotations

import argparse
import shutil
import signal
from pathlib import Path

from benchmarks import gpu_check
from benchmarks.gpu_check.phases import run_phases
from benchmarks.gpu_check.plan import DEADLINE, FILES, LIMITS, PHASES
from benchmarks.gpu_check.processes import cap_file
from benchmarks.gpu_check.run import Run
from benchmarks.gpu_check.summary import card_line, suggested_results_path, summary, verdict
from benchmarks.gpu_check.workers import WORKERS


def parse_limits(items: list[str]) -> dict[str, float]:
    limits = {}
    for item in items:
        name, _, seconds = item.partition("=")
        if name not in LIMITS or not seconds:
            raise SystemExit(f"--limit {item}: expected PHASE=SECONDS, PHASE one of {', '.join(LIMITS)}")
        limits[name] = float(seconds)
    return limits


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu_check", description=gpu_check.__doc__.split("\n\n")[0]
    )
    parser.add_argument("out_dir", nargs="?", help="the folder the summary and logs are written into")
    parser.add_argument("--dry-run", action="store_true", help="every phase under the simulator, at tiny sizes")
    parser.add_argument(
        "--deadline", type=float, default=DEADLINE, help=f"seconds for the whole run (default {DEADLINE:.0f})"
    )
    parser.add_argument("--limit", action="append", default=[], metavar="PHASE=SECONDS", help="one phase's limit")
    parser.add_argument("--phases", default=",".join(PHASES), help="the phases to run (default: all)")
    parser.add_argument("--jobs", type=int, default=0, help="processes at a time (default: one per core)")
    parser.add_argument("--quick", action="store_true", help="the benchmarks' smaller sizes (their --quick)")
    parser.add_argument("--repeats", type=int, default=10, help="timed calls per row (the benchmarks' --repeats)")
    parser.add_argument(
        "--after",
        metavar="TSV",
        help="leave out the tests an earlier run's correctness.tsv lists as run (a second command's rest)",
    )
    parser.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    parser.add_argument("--job", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is None and args.out_dir is None:
        parser.error("OUT_DIR is required")
    args.limits = parse_limits(args.limit)
    if args.after is not None and not Path(args.after).is_file():
        parser.error(f"--after: {args.after} is not a file (an earlier run's correctness.tsv)")
    args.phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    unknown = set(args.phases) - set(PHASES)
    if unknown:
        parser.error(f"--phases: unknown {', '.join(sorted(unknown))}")
    return args


def stop_on_sigterm(signum, frame) -> None:
    """SIGTERM (an outer timeout) ends the command as Ctrl-C does: the running phase's processes are
    killed and the summary is written."""
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        WORKERS[args.worker](args)
        return 0
    signal.signal(signal.SIGTERM, stop_on_sigterm)
    run = Run(args)
    try:
        run_phases(run)
    finally:
        for name in FILES[1:]:
            cap_file(run.out / name)
        text = summary(run)
        (run.out / "summary.md").write_text(text)
        shutil.rmtree(run.scratch, ignore_errors=True)
    print(text.split("\n\n## ")[0])
    print(f"gpu_check: wrote {run.out}")
    card = card_line(run)[1]
    if run.phases["timings"].status in ("passed", "failed", "timed out"):
        print(f"gpu_check: keep the summary as {suggested_results_path(run, card)}")
    return 0 if verdict(run) in ("PASSED", "DRY RUN PASSED") else 1
