"""The Numba CPU backend against the reference interpreter.

Every example spec runs fused and tiled (the default pipeline, sizes that are not
block multiples) and unfused (``pipeline=""``), within float32 error bounds.  The
tiled kernels are the ones ``tests/e2e/test_examples.py`` compiles: a test run
compiles each once (the kernel cache) and checks it against both references.
"""

import re

import numpy as np
import pytest

import attncomp as ac
from attncomp.testing import TOLERANCE, worst_error
from tests.passes import specs as pass_specs
from tests.passes.test_translation_validation import _cases, _inputs


def _as_list(result):
    return list(result) if isinstance(result, tuple) else [result]


@pytest.mark.parametrize("module,spec", _cases())
@pytest.mark.parametrize("pipeline", [None, ""], ids=["tiled", "unfused"])
def test_example_on_cpu_matches_the_interpreter(module, spec, pipeline):
    inputs = _inputs(module, spec, np.random.default_rng(5))
    fn = ac.compile(spec, backend="cpu", pipeline=pipeline)
    got = _as_list(fn(*inputs))
    want = _as_list(ac.interpret(spec, *inputs))
    for g, w in zip(got, want):
        assert g.dtype == np.dtype(np.float32) or g.dtype == w.dtype or g.shape == w.shape
    assert worst_error(got, want) < 5 * TOLERANCE["f32"]


def test_shape_generic_no_recompile():
    fn = ac.compile(pass_specs.causal, backend="cpu")
    rng = np.random.default_rng(0)
    for T, S in [(1, 1), (63, 65), (130, 130)]:
        q = rng.standard_normal((1, 3, T, 8)).astype(np.float32)
        k = rng.standard_normal((1, 3, S, 8)).astype(np.float32)
        got = fn(q, k, k)
        assert worst_error([got], [ac.interpret(pass_specs.causal, q, k, k)]) < 1e-4
    kernel = fn.compilation.program.kernels[0]
    assert len(kernel.signatures) == 1


@ac.spec
def causal_twice(q: ac.f32["B", "H", "T", "D"], k: ac.f32["B", "H", "S", "D"], v: ac.f32["B", "H", "S", "D"]):
    """``pass_specs.causal`` under another name, its output doubled outside the attention."""
    s = (q @ k.mT) * q.shape[-1] ** -0.5
    b, h, i, j = ac.index(s)
    s = ac.where(j <= i, s, -ac.inf)
    return (ac.softmax(s, axis=-1) @ v) * 2.0


def test_specs_that_lower_to_the_same_kernels_share_their_module():
    """The kernels' text names no spec: another spec with the same attention imports the module the
    first compiled (one compile), and its own driver does the rest."""
    first = ac.compile(pass_specs.causal, backend="cpu")
    second = ac.compile(causal_twice, backend="cpu")
    x = np.random.default_rng(3).standard_normal((1, 2, 9, 8)).astype(np.float32)
    assert worst_error([second(x, x, x)], [2.0 * first(x, x, x)]) < 1e-6
    one, two = first.compilation.program, second.compilation.program
    assert one.kernels_module is two.kernels_module and one.module is not two.module
    assert "@causal_twice" in second.source and "@causal" not in one.generated.kernels
    assert f"from {one.kernels_module.__name__} import ATTENTION_KERNEL_0_TASKS, attention_kernel_0" in second.source


def test_generated_source_and_llvm_are_inspectable():
    fn = ac.compile(pass_specs.causal, backend="cpu")
    # the shared parallel launch runs the tasks: no parallel loop is compiled with the kernel
    assert "launch(task_at, n_workers, pack_at)" in fn.source and "prange" not in fn.source
    x = np.ones((1, 1, 20, 8), np.float32)
    fn(x, x, x)
    llvm = fn.inspect_llvm()
    assert "define" in llvm
    assert "<8 x float>" in llvm or "<4 x float>" in llvm  # vectorised loops
    # the row max of the online softmax is a vector reduction, not a scalar chain
    assert re.search(r"llvm\.(vector\.reduce\.fmaximum|maximum)\.v\d+f32", llvm), "row max not vectorised"


def test_the_softmax_step_prefers_wide_vectors_and_sources_name_the_shared_code():
    from numba import njit

    from attncomp.backends import numba_cpu
    from attncomp.backends.numba_cpu import tile_math

    st, m, total = np.zeros((8, 8), np.float32), np.zeros((1, 8), np.float32), np.zeros((1, 8), np.float32)
    acc, rows = np.zeros((1, 8, 4), np.float32), np.zeros((3, 8), np.float32)
    cached = tile_math.softmax_by_keys  # Numba's cache keeps no LLVM IR: compile it again to read it
    fresh = njit(**{k: v for k, v in cached.targetoptions.items() if k not in ("cache", "nopython")})(cached.py_func)
    fresh(st, 8, 8, m, total, acc, rows[0], rows[1], rows[2], 0, tile_math.LAZY)
    (llvm,) = fresh.inspect_llvm().values()
    assert '"prefer-vector-width"="512"' in llvm
    assert "exp2_f32" in llvm and not re.search(r"call .*exp2_f32", llvm)  # called in Python, inlined by LLVM
    # kernels link this code into their cached machine code: its digest is part of their source (the cache key)
    assert f"shared tile code {numba_cpu.SHARED_CODE}" in ac.compile(pass_specs.causal, backend="cpu").source


def test_inputs_are_not_modified_and_strided_inputs_are_read_correctly():
    fn = ac.compile(pass_specs.causal, backend="cpu")
    rng = np.random.default_rng(1)
    big = rng.standard_normal((1, 2, 40, 16)).astype(np.float32)
    q = big[:, :, ::2, ::2]  # strided view
    k = np.asfortranarray(rng.standard_normal((1, 2, 20, 8)).astype(np.float32))
    before = (q.copy(), k.copy())
    got = fn(q, k, k)
    np.testing.assert_array_equal(q, before[0])
    np.testing.assert_array_equal(k, before[1])
    assert worst_error([got], [ac.interpret(pass_specs.causal, q, k, k)]) < 1e-4


def test_read_only_inputs_forward_and_backward():
    """Kernels type the arrays they only read as read-only: a memory map opened read-only (or a
    Dask chunk) is passed as it is, and writable arrays still match the signature."""
    fn = ac.compile(pass_specs.causal_alibi, backend="cpu", window=12)
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((1, 2, 37, 8)).astype(np.float32) for _ in range(3))
    slopes = np.array([0.25, 0.5], np.float32)
    for a in (q, k, v, slopes):
        a.flags.writeable = False
    want = ac.interpret(pass_specs.causal_alibi, q, k, v, slopes, window=12)
    assert worst_error([fn(q, k, v, slopes)], [want]) < 1e-4
    out, pullback = fn.vjp(q, k, v, slopes)
    d_out = rng.standard_normal(out.shape).astype(np.float32)
    d_out.flags.writeable = False
    grads = pullback(d_out)
    reference = ac.compile(pass_specs.causal_alibi, backend="interp", window=12).vjp(q, k, v, slopes)[1](d_out)
    assert worst_error(list(grads), list(reference)) < 1e-3


def test_tasks_are_called_at_their_address_with_their_exact_types():
    """The driver calls the spec's task through ``task_caller`` (``launch.call_task``); arguments of
    other types than the task's signature are a typing error, never a call with the wrong layout."""
    from numba import njit, types
    from numba.core.errors import TypingError

    from attncomp.backends.numba_cpu.intrinsics import task_caller

    fn = ac.compile(pass_specs.causal, backend="cpu")
    assert "def attention_kernel_0_task(worker, n_workers, merging, pack_at):" in fn.source
    assert "= unpack(pack_at, ATTENTION_KERNEL_0_PACK)" in fn.source
    assert "call_task(task_at, np.int64(0), np.int64(1), np.int64(0), pack_at)" in fn.source
    call = task_caller(types.void(types.int64, types.float64[::1]))

    @njit
    def wrong(address, x):
        call(address, np.int64(0), x)

    with pytest.raises(TypingError, match="a task of signature"):
        wrong(0, np.zeros(3, np.float32))


def test_float16_and_float64_specs():
    @ac.spec
    def half(q: ac.f16["T", "D"], k: ac.f16["S", "D"], v: ac.f16["S", "D"]):
        return ac.softmax(q @ k.mT) @ v

    @ac.spec
    def double(q: ac.f64["T", "D"], k: ac.f64["S", "D"], v: ac.f64["S", "D"]):
        return ac.softmax(q @ k.mT) @ v

    rng = np.random.default_rng(2)
    x16 = rng.standard_normal((37, 8)).astype(np.float16)
    out16 = ac.compile(half, backend="cpu")(x16, x16, x16)
    assert out16.dtype == np.float16
    assert worst_error([out16], [ac.interpret(half, x16, x16, x16)]) < TOLERANCE["f16"]
    x64 = rng.standard_normal((37, 8))
    out64 = ac.compile(double, backend="cpu")(x64, x64, x64)
    assert out64.dtype == np.float64
    assert worst_error([out64], [ac.interpret(double, x64, x64, x64)]) < 1e-5


def test_flash_decoding_splits_the_keys_of_a_single_query():
    """One query row of one head is one unit: its keys are split across threads and merged."""
    rng = np.random.default_rng(3)
    fn = ac.compile(pass_specs.spelled_gqa_lse, backend="cpu")
    q = rng.standard_normal((1, 2, 1, 8)).astype(np.float32)
    k = rng.standard_normal((1, 1, 517, 8)).astype(np.float32)
    v = rng.standard_normal((1, 1, 517, 8)).astype(np.float32)
    out, lse = fn(q, k, v)
    want_out, want_lse = ac.interpret(pass_specs.spelled_gqa_lse, q, k, v)
    assert worst_error([out, lse], [want_out, want_lse]) < 1e-5
    assert "n_split" in fn.source and "part_acc" in fn.source


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("trans_a,trans_b", [(0, 0), (0, 1), (1, 0), (1, 1)])
@pytest.mark.parametrize("beta", [0.0, 1.0])
def test_gemm_multiplies_submatrices_in_place(dtype, trans_a, trans_b, beta):
    """The backward's BLAS product: tiles' leading parts and row slices of a larger array, no copies."""
    from numba import njit

    from attncomp.backends.numba_cpu.intrinsics import gemm

    @njit
    def product(trans_a, trans_b, m, n, k, a, b, beta, c):
        gemm(trans_a, trans_b, m, n, k, a, b, beta, c[2:])

    rng = np.random.default_rng(0)
    m, n, k = 5, 7, 3
    a, b, c = (rng.standard_normal(shape).astype(dtype) for shape in ((9, 9), (9, 8), (12, 11)))
    op_a = a[:k, :m].T if trans_a else a[:m, :k]
    op_b = b[:n, :k].T if trans_b else b[:k, :n]
    want = c.copy()
    want[2 : 2 + m, :n] = op_a.astype(np.float64) @ op_b + beta * c[2 : 2 + m, :n]
    product(trans_a, trans_b, m, n, k, a, b, beta, c)
    np.testing.assert_allclose(c, want, rtol=1e-5, atol=1e-5)


def test_the_workers_take_each_task_once_by_ticket():
    """``take_ticket`` hands out 0, 1, 2, ... once each, whichever thread asks (the kernels' workers
    take their tasks by it); the kernel's task loop is written with it."""
    from numba import njit, prange
    from numba.core.errors import TypingError

    from attncomp.backends.numba_cpu.intrinsics import take_ticket

    @njit(parallel=True)
    def take_all(tickets, taken, n_workers):
        for _ in prange(n_workers):
            while True:
                task = take_ticket(tickets)
                if task >= taken.size:
                    break
                taken[task] += 1

    taken = np.zeros(10_000, np.int64)
    tickets = np.zeros(1, np.int64)
    take_all(tickets, taken, 4)
    assert (taken == 1).all() and tickets[0] == taken.size + 4
    fn = ac.compile(pass_specs.causal, backend="cpu")
    assert "task = take_ticket(tickets)" in fn.source and "qb = n_qb - 1 - unit % n_qb" in fn.source
    with pytest.raises(TypingError, match="take_ticket takes a one-dimensional int64 array"):
        njit(lambda x: take_ticket(x))(np.zeros(1, np.int32))


def test_float32_tanh_is_within_two_ulp_and_kernels_call_it():
    """Soft-capped scores use the shared float32 tanh (series below 1/2, exponential above): within
    2.5e-7 of float64's over the range, exact at 0, 1 at infinity, NaN kept; float64 keeps NumPy's."""
    from numba import njit

    from attncomp.backends.numba_cpu.tile_math import tanh
    from tests.conftest import load_example

    @njit
    def apply(x, out):
        for i in range(x.size):
            out[i] = tanh(x[i])

    x = np.concatenate([np.linspace(-12, 12, 40001), np.geomspace(1e-30, 12, 20001)]).astype(np.float32)
    x = np.concatenate([x, -x[40001:]])
    got = np.empty_like(x)
    apply(x, got)
    want = np.tanh(x.astype(np.float64))
    assert np.max(np.abs(got - want) / np.maximum(np.abs(want), 1e-38)) < 2.5e-7
    special = np.array([0.0, np.inf, -np.inf, np.nan], np.float32)
    out = np.empty_like(special)
    apply(special, out)
    assert out[0] == 0 and out[1] == 1 and out[2] == -1 and np.isnan(out[3])
    wide = np.linspace(-3, 3, 101)
    out64 = np.empty_like(wide)
    apply(wide, out64)
    np.testing.assert_allclose(out64, np.tanh(wide), rtol=1e-15)
    fn = ac.compile(load_example("softcap").causal_softcap, backend="cpu", cap=1.0)
    source = fn.source
    assert "tanh_f32(" in source and "math.tanh" not in source


def test_float32_exp_and_log_of_score_functions_are_accurate_and_vectorise():
    """``ac.exp`` and ``ac.log`` in a float32 score function run ``tile_math.exp_f32`` and ``log_f32``
    (libm's are scalar; sigmoid attention's ``log sigmoid`` calls both per score): log within 3 ulp,
    exp within its float32 input's own conditioning (|x| 2**-24 relative, 4e-6 near 88), and the
    special values as libm gives them."""
    from numba import njit

    from attncomp.backends.numba_cpu import tile_math

    @njit(fastmath=tile_math.FASTMATH, error_model="numpy")
    def apply(x, logs, exps):
        for i in range(x.size):
            logs[i] = tile_math.log_f32(x[i])
            exps[i] = tile_math.exp_f32(x[i])

    rng = np.random.default_rng(0)
    x = np.concatenate([np.exp(rng.uniform(-103, 88, 50000)), rng.uniform(-100, 88, 50000)]).astype(np.float32)
    logs, exps = np.empty_like(x), np.empty_like(x)
    apply(x, logs, exps)
    wide = x.astype(np.float64)
    positive = x > 0
    want = np.log(wide[positive])
    assert np.max(np.abs(logs[positive] - want) / np.spacing(np.abs(want).astype(np.float32))) < 3
    want = np.exp(wide)
    normal = (want > 1.2e-38) & (want < 3.4e38)
    bound = 2e-7 + np.abs(wide[normal]) * 2.0**-24 * 1.5
    assert np.all(np.abs(exps[normal] - want[normal]) / want[normal] <= bound)
    special = np.array([0.0, -1.0, np.inf, -np.inf, np.nan, 1e-42, 89.0, -88.0], np.float32)
    logs, exps = np.empty_like(special), np.empty_like(special)
    apply(special, logs, exps)
    assert logs[0] == -np.inf and np.isnan(logs[1]) and logs[2] == np.inf and np.isnan(logs[3]) and np.isnan(logs[4])
    assert abs(logs[5] - np.log(1e-42)) < 1e-3  # a subnormal
    assert exps[0] == 1 and exps[2] == np.inf and exps[3] == 0 and np.isnan(exps[4]) and exps[6] == np.inf
    assert exps[7] == 0  # below float32's normal range: flushed, as the softmax's exp2 does
    llvm = next(iter(apply.inspect_llvm().values()))
    assert re.search(r"<(8|16) x float>", llvm), "the exp and log loop was not vectorised"
    from tests.conftest import load_example

    source = ac.compile(load_example("sigmoid_attention").causal_sigmoid, backend="cpu").source
    assert "exp_f32(" in source and "log_f32(" in source


def test_element_loops_vectorise():
    """The kernels' element loops (the softmax's exp, the backward's per-element gradient) compile
    to vector code.  A division's zero check (Numba's Python error model) kept the backward's loop
    scalar, at well under half the speed: the kernels take NumPy's error model."""
    from numba import njit

    from attncomp.backends.codegen import select_min
    from attncomp.backends.numba_cpu import tile_math
    from attncomp.backends.numba_cpu.signatures import Jit

    def vectorised(function) -> bool:  # exp2's floor on a vector of float32
        llvm = next(iter(function.inspect_llvm().values()))
        return re.search(r"llvm\.floor\.v(8|16)f32", llvm) is not None

    softmax = njit(fastmath=tile_math.FASTMATH)(tile_math.softmax_by_keys.py_func)
    st = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)
    m, total, mx, m_safe, row_sum = (
        np.zeros((1, 64), np.float32),
        np.zeros((1, 64), np.float32),
        st.max(axis=0),
        np.zeros(64, np.float32),
        np.zeros(64, np.float32),
    )
    softmax(st, 31, 29, m, total, np.zeros((1, 64, 8), np.float32), mx, m_safe, row_sum, 0, tile_math.LAZY)
    assert vectorised(softmax), "the softmax's exp loop was not vectorised"

    assert "error_model='numpy'" in str(Jit())
    namespace = {"np": np, "exp_nonpositive_f32": tile_math.exp_nonpositive_f32, "tanh_f32": tile_math.tanh_f32}
    exec(
        "def loop(s, out, j0, last, scale):\n"
        "    for c in range(s.size):\n"
        f"        j = {select_min('(j0 + c)', 'last')}\n"
        "        x = np.float32(tanh_f32(s[c] / scale) * np.float32(j))\n"
        "        out[c] = exp_nonpositive_f32(x)\n",
        namespace,
    )
    loop = njit(fastmath=tile_math.FASTMATH, error_model="numpy")(namespace["loop"])
    s = np.linspace(-3, 0, 37, dtype=np.float32)
    out = np.empty_like(s)
    loop(s, out, 0, 30, np.float32(2.0))
    want = np.exp(np.tanh(s / 2.0) * np.minimum(np.arange(37), 30))
    np.testing.assert_allclose(out, want, rtol=2e-6, atol=1e-30)
    assert vectorised(loop), "the gradient's element loop was not vectorised"


def test_the_backward_computes_delta_in_one_pass():
    """``delta = sum(dO * O)`` (a product only its row sum reads) is one ``np.einsum``, outside
    numpy's error state (einsum raises no floating-point warnings); the gradients still match."""
    fn = ac.compile(pass_specs.causal, backend="cpu")
    source = fn.backward.compilation.program.source
    assert "np.einsum('...e,...e->...'" in source and "np.multiply" not in source
    run = source[source.index("def run(") :]
    assert "np.errstate" not in run
    rng = np.random.default_rng(3)
    q, k, v, d_out = (rng.standard_normal((1, 2, 9, 4)).astype(np.float32) for _ in range(4))
    _, pull = fn.vjp(q, k, v)
    _, want = ac.compile(pass_specs.causal, backend="interp").vjp(q, k, v)
    for got, ref in zip(pull(d_out), want(d_out)):
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)


def test_torch_imported_after_a_cpu_call_keeps_its_own_openmp_runtime():
    """A CPU call starts Numba's OpenMP pool (the system's libgomp); torch imported afterwards
    must load the runtime its wheel carries, not share that one (which made its SDPA five times
    slower): the pool's start loads torch's runtime first (``numba_cpu/openmp.py``)."""
    import subprocess
    import sys
    from pathlib import Path

    from attncomp.backends.numba_cpu.openmp import torch_openmp_path

    if not sys.platform.startswith("linux") or torch_openmp_path() is None:
        pytest.skip("no torch wheel with its own OpenMP runtime here")
    script = (
        "import numpy as np, attncomp as ac\n"
        "from tests.passes import specs\n"
        "q = np.ones((1, 1, 4, 8), np.float32)\n"
        "ac.compile(specs.causal, backend='cpu')(q, q, q)\n"
        "import torch\n"
        "torch.ones(4).sum()\n"
        "print(sorted({line.split()[-1] for line in open('/proc/self/maps') if 'libgomp' in line}))\n"
    )
    root = str(Path(__file__).resolve().parents[2])
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=root).stdout
    assert torch_openmp_path() in out, out


def test_kernels_keep_scipys_blas_on_one_thread_and_restore_it():
    """A kernel's driver sets SciPy's OpenBLAS to one thread (its tasks call BLAS from every worker)
    and back to the count it had when it ends."""
    from numba import njit

    from attncomp.backends.numba_cpu import intrinsics

    lib = intrinsics.scipy_openblas()
    if lib is None:
        pytest.skip("SciPy's OpenBLAS is not found: the kernels leave BLAS threads alone")

    @njit
    def pinned():
        saved = intrinsics.pin_blas_threads()
        inside = np.int64(intrinsics.pin_blas_threads())  # the count while pinned (pinning again: 1)
        intrinsics.restore_blas_threads(saved)
        return saved, inside

    before = lib.scipy_openblas_get_num_threads()
    try:
        lib.scipy_openblas_set_num_threads(2)
        assert pinned() == (2, 1)
        assert lib.scipy_openblas_get_num_threads() == 2
        fn = ac.compile(pass_specs.causal, backend="cpu")
        q = np.random.default_rng(0).standard_normal((1, 2, 80, 8)).astype(np.float32)
        fn(q, q, q)  # BLAS tiles (80 rows), then the count the kernel found
        assert lib.scipy_openblas_get_num_threads() == 2
    finally:
        lib.scipy_openblas_set_num_threads(before)


def test_a_kernel_that_raises_gives_blas_its_threads_back(monkeypatch):
    """A task that raises (Numba's MemoryError) skips its driver's restore; the call's error path
    sets SciPy's OpenBLAS back to the count the pin found."""
    from numba import njit

    from attncomp.backends.numba_cpu import intrinsics

    lib = intrinsics.scipy_openblas()
    if lib is None:
        pytest.skip("SciPy's OpenBLAS is not found: the kernels leave BLAS threads alone")

    @njit
    def pinned_then_failing(n):
        intrinsics.pin_blas_threads()
        if n > 0:
            raise MemoryError("a task's work buffer")
        return n

    class FailingModule:
        @staticmethod
        def run(*args):
            return pinned_then_failing(1)

    before = lib.scipy_openblas_get_num_threads()
    try:
        lib.scipy_openblas_set_num_threads(2)
        fn = ac.compile(pass_specs.causal, backend="cpu")
        q = np.random.default_rng(0).standard_normal((1, 2, 8, 8)).astype(np.float32)
        fn(q, q, q)
        monkeypatch.setattr(fn.compilation.program, "loaded_module", FailingModule)
        with pytest.raises(MemoryError, match="work buffer"):
            fn(q, q, q)
        assert lib.scipy_openblas_get_num_threads() == 2  # not the one thread the kernel pinned
        lib.scipy_openblas_set_num_threads(1)  # a user's own single thread stays as it is after errors
        with pytest.raises(MemoryError):
            fn(q, q, q)
        assert lib.scipy_openblas_get_num_threads() == 1
    finally:
        lib.scipy_openblas_set_num_threads(before)


@pytest.mark.parametrize("shape", [(3, 100, 37), (5,), (2, 0, 4), (1, 64, 8)])
def test_block_summaries_are_numpys_reduceat(shape):
    """The per-block minimum and maximum mask-elimination bounds tiles with, along every axis (the
    interpreter's and the cpu backend's)."""
    from attncomp.backends.numba_cpu.runtime import block_reduce

    x = np.random.default_rng(0).integers(-5, 5, shape).astype(np.int32)
    for axis in range(len(shape)):
        for block in (1, 7, 64, 200):
            for kind, reduce in (("min", np.minimum), ("max", np.maximum)):
                got = block_reduce(x, axis, block, kind)
                starts = np.arange(0, shape[axis], block)
                want = reduce.reduceat(x, starts, axis=axis) if shape[axis] else x
                np.testing.assert_array_equal(got, want)
                assert got.dtype == x.dtype


@pytest.mark.parametrize("kernels", ["SkylakeX", "Haswell"])
def test_scores_by_rows_and_by_keys_both_match_the_interpreter(monkeypatch, kernels):
    """Tiles of 64 rows hold their scores by keys where OpenBLAS's small-matrix kernels multiply them
    (``score_layout``), by rows elsewhere; whichever kernels this machine's BLAS runs, both layouts
    give the interpreter's outputs (ALiBi in a window: unmasked and masked tiles, rows past the last)."""
    import attncomp.backends.numba_cpu.kernel as kernel

    monkeypatch.setattr(kernel, "blas_kernels", lambda: kernels)
    pipeline = "cse,softmax-fusion,flash-tiling{block_q=64,block_k=32},mask-elimination,canonicalize,cse,dce"
    fn = ac.compile(pass_specs.causal_alibi, backend="cpu", pipeline=pipeline, window=40)
    by_keys = kernels == "SkylakeX"
    assert ("st = ks @ q_tileᵀ" in fn.source) == by_keys and ("srm = q_tile @ ksᵀ" in fn.source) != by_keys
    rng = np.random.default_rng(6)
    q, k, v = (rng.standard_normal((2, 2, 150, 16)).astype(np.float32) for _ in range(3))
    slopes = np.array([0.3, 0.05], np.float32)
    want = ac.interpret(pass_specs.causal_alibi, q, k, v, slopes, window=40)
    assert worst_error(fn(q, k, v, slopes), want) < TOLERANCE["f32"]


def test_a_bias_read_along_the_keys_is_scored_row_by_row():
    """bias[b, h, i, j] (T5's position bias, a mask given as data): scores held by rows whatever the BLAS
    kernels, each row's keys read in order at unclamped positions, by unsigned indices (one run of
    memory, vectorised), the rows' maxima taken after."""
    rows_first = re.compile(r"srm\[r, c\] = xv\s+row_max = MAXIMUM\(row_max, xv\)")
    source = ac.compile(pass_specs.dense_bias).source
    assert rows_first.search(source) and "st = ks @ q_tileᵀ" not in source
    assert re.search(r"arg_\d+\[np.uint64\(bi_0\), np.uint64\(bi_1\), np.uint64\(i_\d+\), np.uint64\(j_\d+\)\]", source)
    assert re.search(r"j_\d+ = \(j0_\d+ \+ c\)", source)  # no clamp to the last key
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((1, 2, 150, 16)).astype(np.float32) for _ in range(3))
    bias = rng.standard_normal((1, 2, 150, 150)).astype(np.float32)
    bias[..., 100:] = -np.inf
    fn = ac.compile(pass_specs.dense_bias)
    assert worst_error(fn(q, k, v, bias), ac.interpret(pass_specs.dense_bias, q, k, v, bias)) < TOLERANCE["f32"]
    # the bias's gradient: each row's adds at unsigned indices too, against the interpreter's
    assert re.search(
        r"part_0\[slot, np.uint64\(p_0\), np.uint64\(p_1\), np.uint64\(i_\d+\), np.uint64\(j_\d+\)\]",
        fn.backward.source,
    )
    bias[..., 100:] = 0.0
    d_out = rng.standard_normal(q.shape).astype(np.float32)
    got = fn.vjp(q, k, v, bias)[1](d_out)
    want = ac.compile(pass_specs.dense_bias, backend="interp").vjp(q, k, v, bias)[1](d_out)
    assert all(worst_error(g, w) < 1e-4 for g, w in zip(got, want))
