"""Runs tests/cuda_sim in its own pytest process under Numba's CUDA simulator.

``NUMBA_ENABLE_CUDASIM`` must be set before Numba is imported, which this
process has already done, so the simulator tests get a fresh interpreter.

The process runs on one core, as a batch process (``SCHED_BATCH``): most of its blocks run as
generators in one thread (``tests/cuda_sim/sim_lanes.py``), and those on the simulator's threads
hand the interpreter lock to each other at every barrier and warp instruction, which on two
cores, or woken with priority over the lock's holder, spends more time switching than running
(measured in docs/performance.md, "The test suite"); the run's other workers keep the cores.
"""

import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def one_batch_core() -> Callable[[], None] | None:
    """What makes the simulator's process a batch process on the last of this process's cores
    (None where the platform has neither); the test run's other workers keep every core."""
    if not hasattr(os, "sched_setaffinity") or not hasattr(os, "SCHED_BATCH"):
        return None
    core = max(os.sched_getaffinity(0))

    def pin() -> None:
        os.sched_setaffinity(0, {core})
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))

    return pin


@pytest.mark.long
def test_cuda_backend_under_the_simulator():
    if importlib.util.find_spec("numba_cuda") is None:
        pytest.skip("the cuda extra (numba-cuda) is not installed: pip install -e '.[cuda]'")
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    command = [sys.executable, "-m", "pytest", "tests/cuda_sim", "-q", "-p", "no:cacheprovider", "-o", "addopts="]
    done = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900, preexec_fn=one_batch_core()
    )
    report = done.stdout + done.stderr
    assert done.returncode == 0, f"simulator tests failed (exit {done.returncode}):\n{report}"
    assert " passed" in report and " failed" not in report, report
