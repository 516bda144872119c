"""Runs tests/cuda_sim in its own pytest process under Numba's CUDA simulator.

``NUMBA_ENABLE_CUDASIM`` must be set before Numba is imported, which this
process has already done, so the simulator tests get a fresh interpreter.

The process runs on one core, as a batch process. The simulator runs each CUDA thread as a
Python thread, and a warp instruction or a barrier hands the interpreter lock from thread to
thread hundreds of times a block. Spread over two cores, every hand-off woke a thread on the
other core; and a thread woken on the same core preempts the one that woke it, which still holds
the lock, so the two switch back and forth before either runs on. Pinned (``sched_setaffinity``)
and with ``SCHED_BATCH`` (a woken thread waits for the running one's turn to end), the kernel's
time in those switches falls below the interpreter's. Measured on the 2-core machine, a decoder's
batch-invariance steps and ``test_sim_flash.py``: 64 s on both cores (34 s user, 39 s system);
42 s pinned (25 s, 17 s); 29 s pinned as a batch process (22 s, 7 s), the other core left to
the rest of the suite.
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
