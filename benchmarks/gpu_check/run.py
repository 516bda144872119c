"""One run of the command: its options, its clock (each phase's time limit), its folder, and the
phases' records."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.gpu_check.plan import FILES, LIMITS, PHASES, RESERVE, ROOT


@dataclass
class Phase:
    name: str
    status: str = "skipped"  # passed, failed, skipped, timed out
    seconds: float = 0.0
    note: str = ""
    data: dict = field(default_factory=dict)


def cores() -> int:
    """The cores this process may run on (its affinity, where a container narrows it), else all."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0)) or 1
    return os.cpu_count() or 1


class Run:
    """One run of the command: its options, its clock, its folder and the phases' records."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.out = Path(args.out_dir).resolve()
        self.out.mkdir(parents=True, exist_ok=True)
        for name in FILES:  # a folder reused: no file of an earlier run is left to be mistaken for this one's
            (self.out / name).unlink(missing_ok=True)
        self.start = time.monotonic()
        self.deadline = self.start + args.deadline
        #: every phase's record, replaced as the phase runs (one never reached: the command was stopped)
        self.phases = {name: Phase(name, note="not reached: the command was stopped") for name in PHASES}
        self.scratch = Path(tempfile.mkdtemp(prefix="gpu_check_"))
        self.jobs = args.jobs or (min(2, cores()) if args.dry_run else cores())

    # time ------------------------------------------------------------------------------------
    def left(self) -> float:
        return self.deadline - RESERVE - time.monotonic()

    def own_limit(self, phase: str) -> float:
        return float(self.args.limits.get(phase, LIMITS[phase]))

    def limit(self, phase: str) -> float:
        """The phase's own limit, or, when what is left of the deadline cannot hold it and the limits
        of the phases still to run, its share of what is left in proportion to those limits: a late
        run shortens every phase still to come, not the last ones only."""
        own = self.own_limit(phase)
        later = sum(self.own_limit(p) for p in PHASES[PHASES.index(phase) + 1 :] if p in self.args.phases)
        left = max(self.left(), 0.0)
        return min(own, left * own / (own + later)) if own + later > 0 else 0.0

    # subprocesses ----------------------------------------------------------------------------
    def env(self, gpu_tests: bool = False) -> dict[str, str]:
        """The environment of a child: the checkout on the path; the simulator for a dry run, else
        ``ATTNCOMP_TEST_GPU=1`` for the tests; no pytest variables of a calling pytest."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_XDIST", "PYTEST_CURRENT"))}
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
        env["PYTHONUNBUFFERED"] = "1"
        env.pop("NUMBA_ENABLE_CUDASIM", None)
        env.pop("ATTNCOMP_TEST_GPU", None)
        if self.args.dry_run:
            env["NUMBA_ENABLE_CUDASIM"] = "1"
        elif gpu_tests:
            env["ATTNCOMP_TEST_GPU"] = "1"
        return env

    def worker(self, kind: str, result: Path, job: str | None = None) -> list[str]:
        """The command line of one of the workers (``--worker``, ``workers.WORKERS``)."""
        command = [sys.executable, "-m", "benchmarks.gpu_check", "--worker", kind, "--result", str(result)]
        if job is not None:
            command += ["--job", job]
        if self.args.dry_run:
            command.append("--dry-run")
        if self.args.quick:
            command.append("--quick")
        return command + ["--repeats", str(self.args.repeats)]
