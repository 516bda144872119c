"""What a cpu kernel module compiles: its own code, not the shared tile code or a parallel loop.

The shared tile code (``tile_math``) is compiled once a process for each signature and called
by the kernels without a copy in their modules (``shared_calls``); the tasks run on the one
parallel launch every kernel shares (``launch``), with their arguments packed on the driver's
stack.  A kernel loaded from the disk cache in a new process finds both (``tests/e2e/test_cache.py``).
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from numba import njit, types
from numba.core.errors import TypingError

import attncomp as ac
from tests.passes import specs as pass_specs


def test_kernels_declare_the_shared_tile_code_and_compile_no_parallel_loop():
    fn = ac.compile(pass_specs.causal, backend="cpu")
    rng = np.random.default_rng(0)
    for rows in (2, 70):  # the few-row path (group_scores, group_values) and BLAS's tiles
        x = rng.standard_normal((2, 3, rows, 16)).astype(np.float32)
        assert np.abs(fn(x, x, x) - ac.interpret(pass_specs.causal, x, x, x)).max() < 1e-5
    llvm = fn.inspect_llvm()
    shared = [line for line in llvm.splitlines() if "tile_math" in line and line.startswith(("declare", "define"))]
    names = {name for name in ("group_scores", "group_values", "softmax_by_keys", "softmax_by_rows") if name in llvm}
    by_keys = "st = ks @ q_tileᵀ" in fn.source  # scores held by keys (``score_layout``): their own softmax step
    assert names == {"group_scores", "group_values", "softmax_by_rows"} | ({"softmax_by_keys"} if by_keys else set())
    assert shared and all(line.startswith("declare") for line in shared), shared[:3]
    assert "numba_parfor_gufunc" not in llvm
    assert re.search(r"call .*@\S*launch", llvm), "the driver does not call the shared launch"


def test_a_pack_of_other_types_than_the_tasks_is_a_typing_error():
    from attncomp.backends.numba_cpu.launch import pack_address, unpack

    pack = types.Tuple((types.float64[::1], types.int64))

    @njit
    def roundtrip(x, n):
        found = pack_address((x, n), pack)
        y, m = unpack(found, pack)
        return y[0] + m

    assert roundtrip(np.ones(3), 2) == 3.0

    @njit
    def short(x):
        return pack_address((x,), pack)

    with pytest.raises(TypingError, match="a pack of 1 values"):
        short(np.ones(3))
