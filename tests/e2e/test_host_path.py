"""``python -m benchmarks.host_path``: a CUDA decoder step's host path on Numba's real device arrays,
without a GPU (in a process of its own: it changes that process's Numba)."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("numba_cuda") is None, reason="the cuda extra (numba-cuda) is absent"
)


def host_path(*options: str) -> str:
    """What ``python -m benchmarks.host_path`` prints with ``options``, run outside the simulator."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.host_path", *options],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_a_decoder_step_runs_its_host_path_on_numbas_arrays():
    out = host_path("--cache", "64", "--steps", "3", "--profile")
    line = next(line for line in out.splitlines() if line.startswith("decoder step,"))
    assert "64 cached of 128" in line and "(2 launches, 0 copies in and 0 out a step)" in line  # append, attention
    assert "sliced" in out  # the profile names the cache views' function


def test_a_paged_step_runs_its_host_path_on_numbas_arrays():
    """The GPU serving row's step on a device pool: its new rows appended first (one launch per page
    array, their pages and slots in one copy), then one paged call for the cascade and one for each
    sequence's own keys, cached and new (the positions, starts and counts of each in one copy)."""
    out = host_path("--serving", "--steps", "3")
    line = next(line for line in out.splitlines() if line.startswith("paged decode step,"))
    assert "(8 launches, 9 copies in and 4 out a step)" in line, line
