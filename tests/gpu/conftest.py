"""Tests that need a real CUDA GPU: the CUDA backend at its default blocks and sizes, and
``fn.to_torch()`` on CUDA tensors.

They are collected only when ``ATTNCOMP_TEST_GPU=1`` asks for them (with the simulator's tests,
which then run on the GPU too)::

    ATTNCOMP_TEST_GPU=1 python -m pytest tests/cuda_sim tests/gpu

Without that variable this directory is not collected, so the CPU suite never starts Numba's
CUDA target.  With it and no GPU, every test skips with the reason.
"""

from __future__ import annotations

import os

if os.environ.get("ATTNCOMP_TEST_GPU") != "1" or os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
    collect_ignore_glob = ["test_*.py"]
