"""Runs tests/cuda_sim in its own pytest process under Numba's CUDA simulator.

``NUMBA_ENABLE_CUDASIM`` must be set before Numba is imported, which this
process has already done, so the simulator tests get a fresh interpreter.

The process runs on one core. The simulator runs each CUDA thread as a Python thread, and a
warp instruction or a barrier hands the interpreter lock from thread to thread hundreds of
times a block: spread over two cores, every hand-off wakes a thread on the other core, and the
kernel's time in those wake-ups passed the interpreter's own. Measured on the 2-core machine
(a decoder's batch-invariance steps and ``test_sim_flash.py``): 64 s, 34 s user and 39 s
system, on both cores; on one, 42 s, 25 s user and 17 s system, the other core left to the
rest of the suite.
"""

import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def one_core() -> Callable[[], None] | None:
    """What pins the simulator's process to the last of this process's cores (None where the
    platform cannot pin); the test run's other workers keep every core."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    core = max(os.sched_getaffinity(0))
    return lambda: os.sched_setaffinity(0, {core})


def test_cuda_backend_under_the_simulator():
    if importlib.util.find_spec("numba_cuda") is None:
        pytest.skip("the cuda extra (numba-cuda) is not installed: pip install -e '.[cuda]'")
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    command = [sys.executable, "-m", "pytest", "tests/cuda_sim", "-q", "-p", "no:cacheprovider", "-o", "addopts="]
    done = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900, preexec_fn=one_core()
    )
    report = done.stdout + done.stderr
    assert done.returncode == 0, f"simulator tests failed (exit {done.returncode}):\n{report}"
    assert " passed" in report and " failed" not in report, report
