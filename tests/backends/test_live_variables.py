"""``backends/live_variables.py``: the live variables of each block, found with a work list, are the
sets Numba's own sweeps find, on a CPU kernel and a CUDA kernel as they compile."""

from __future__ import annotations

import importlib
import importlib.util

import numpy as np
import pytest
from numba import njit

import attncomp as ac
from attncomp.backends import live_variables
from tests.passes import specs as pass_specs


def _comparing(monkeypatch, module_name: str) -> list[tuple[int, bool]]:
    """Make ``module_name``'s ``compute_live_map`` compute both and record (blocks, same)."""
    live_variables.install(module_name)
    module = importlib.import_module(module_name)
    theirs = live_variables.original(module_name)
    assert theirs is not None and module.compute_live_map is live_variables.compute_live_map
    compared = []

    def both(cfg, blocks, var_use_map, var_def_map):
        ours = live_variables.compute_live_map(cfg, blocks, var_use_map, var_def_map)
        expected = theirs(cfg, blocks, var_use_map, var_def_map)
        compared.append((len(blocks), ours == expected))
        return ours

    monkeypatch.setattr(module, "compute_live_map", both)
    return compared


def test_a_cpu_task_has_numbas_live_variables(monkeypatch):
    fn = ac.compile(pass_specs.causal, backend="cpu")
    x = np.ones((1, 2, 5, 8), np.float32)
    fn(x, x, x)
    (task,) = [k for k in fn.compilation.program.kernels if k.py_func.__name__.endswith("_task")]
    compared = _comparing(monkeypatch, "numba.core.analysis")
    options = {k: v for k, v in task.targetoptions.items() if k not in ("cache", "nopython")}
    njit(**options)(task.py_func).compile(task.signatures[0])  # compiled again, not from the cache
    assert compared and all(same for _, same in compared)
    assert max(n for n, _ in compared) > 50  # the task's blocks


@pytest.mark.skipif(importlib.util.find_spec("numba_cuda") is None, reason="needs the cuda extra")
def test_a_cuda_kernel_has_numba_cudas_live_variables(monkeypatch):
    from attncomp.backends import numba_cuda
    from attncomp.backends.numba_cuda.ptx import compile_ptx_for

    impl = numba_cuda.build(ac.compile(pass_specs.causal, backend="interp").module)
    kernel = next(k for k in impl.kernels(64, 64) if k.name.startswith("attention_kernel_0["))
    compared = _comparing(monkeypatch, "numba.cuda.core.analysis")
    compile_ptx_for(kernel.py_func, kernel.signature, [(8, 0)], kernel.launch_bounds)
    assert compared and all(same for _, same in compared)
    assert max(n for n, _ in compared) > 20


def test_a_loop_keeps_what_its_next_iteration_reads():
    @njit
    def running(xs):
        total, previous = 0.0, 0.0
        for x in xs:
            if x > 0:
                total += previous
            previous = x
        return total

    live_variables.install("numba.core.analysis")
    assert running(np.array([1.0, 2.0, -1.0, 3.0])) == 0.0 + 1.0 + -1.0


def test_a_cpu_call_imports_no_cuda_compiler():
    """The cpu backend installs the work list in Numba's analysis only: importing numba-cuda's
    compiler would add a fifth of a second to every process's first call."""
    import subprocess
    import sys

    probe = (
        "import sys, numpy as np; import attncomp as ac; from tests.passes import specs; "
        "fn = ac.compile(specs.causal, backend='cpu'); x = np.ones((1, 1, 4, 8), np.float32); fn(x, x, x); "
        "print(sorted(m for m in sys.modules if m.startswith(('numba.cuda', 'numba_cuda'))))"
    )
    root = __file__.rsplit("/tests/", 1)[0]
    done = subprocess.run([sys.executable, "-c", probe], cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"
