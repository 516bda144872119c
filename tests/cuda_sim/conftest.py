"""Tests that run the CUDA backend under Numba's CUDA simulator, or on a real GPU.

They need ``NUMBA_ENABLE_CUDASIM=1`` set before Numba is imported, so they
run in their own process: ``tests/backends/test_cuda_simulator.py`` starts
``python -m pytest tests/cuda_sim`` with it set (on one core, as a batch
process: see why there).  In any other pytest process this directory is not
collected (importing its modules would start Numba's CUDA target without the
simulator), unless ``ATTNCOMP_TEST_GPU=1`` asks for the same tests on the GPU::

    ATTNCOMP_TEST_GPU=1 python -m pytest tests/cuda_sim tests/gpu
"""

from __future__ import annotations

import os

import pytest

if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
    # A block runs as generators in this thread where its kernel can be rewritten (sim_lanes.py),
    # else on the simulator's threads (sim_blocks.py), for which Python's own thread switch
    # interval (5 ms) is kept: they mostly switch by waiting at a barrier or a warp instruction,
    # and a forced switch every 0.5 ms made the tensor-core tests a twelfth slower (0.1 ms, a sixth).
    from tests.cuda_sim import sim_blocks, sim_lanes, sim_memory

    sim_memory.install()
    sim_blocks.install(first=sim_lanes.ran_as_lanes)
elif os.environ.get("ATTNCOMP_TEST_GPU") != "1":
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture
def banks():
    """The emulation's bank counts since the test began (on a GPU: counts of nothing, never read)."""
    from attncomp.backends.numba_cuda.mma import warp_sim_copies

    warp_sim_copies.reset_bank_counts()
    yield warp_sim_copies.bank_counts
    warp_sim_copies.reset_bank_counts()


def _run_blocks(monkeypatch, runner: str) -> str:
    from tests.cuda_sim import sim_lanes

    monkeypatch.setattr(sim_lanes, "RUNNER", runner)
    return runner


@pytest.fixture(params=["lanes", "threads"])
def runner(request, monkeypatch) -> str:
    """Each way the harness runs a block: its threads as generators in one thread (``sim_lanes.py``)
    or as the simulator's threads (``sim_blocks.py``)."""
    return _run_blocks(monkeypatch, request.param)


@pytest.fixture
def threads(monkeypatch) -> None:
    """Blocks on the simulator's threads (``sim_blocks.py``) only."""
    _run_blocks(monkeypatch, "threads")


@pytest.fixture
def lanes(monkeypatch) -> None:
    """Blocks as generators in one thread (``sim_lanes.py``) only."""
    _run_blocks(monkeypatch, "lanes")
