"""Tests that run the CUDA backend under Numba's CUDA simulator.

They need ``NUMBA_ENABLE_CUDASIM=1`` set before Numba is imported, so they
run in their own process: ``tests/backends/test_cuda_simulator.py`` starts
``python -m pytest tests/cuda_sim`` with it set.  In any other pytest process
this directory is not collected (importing its modules would start Numba's
CUDA target without the simulator).
"""

from __future__ import annotations

import os
import sys

if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
    collect_ignore_glob = ["test_*.py"]
else:
    # The simulator runs each CUDA thread as a Python thread and polls them from the main
    # thread; switching threads every 0.5 ms instead of every 5 ms halves its run time.
    sys.setswitchinterval(5e-4)
