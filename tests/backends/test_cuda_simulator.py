"""Runs tests/cuda_sim in its own pytest process under Numba's CUDA simulator.

``NUMBA_ENABLE_CUDASIM`` must be set before Numba is imported, which this
process has already done, so the simulator tests get a fresh interpreter.
"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_cuda_backend_under_the_simulator():
    if importlib.util.find_spec("numba_cuda") is None:
        pytest.skip("the cuda extra (numba-cuda) is not installed: pip install -e '.[cuda]'")
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    command = [sys.executable, "-m", "pytest", "tests/cuda_sim", "-q", "-p", "no:cacheprovider", "-o", "addopts="]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    report = done.stdout + done.stderr
    assert done.returncode == 0, f"simulator tests failed (exit {done.returncode}):\n{report}"
    assert " passed" in report and " failed" not in report, report
