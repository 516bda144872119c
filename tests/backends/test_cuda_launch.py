"""What a GPU would refuse, checked without one: thread blocks against the register file, and the
marks on the kernels' inline PTX."""

import importlib.util

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("numba_cuda") is None, reason="the cuda extra (numba-cuda) is not installed"
)


@pytest.mark.parametrize(
    "threads,registers,fits",
    [
        (128, 255, True),  # four warps at the most registers a thread can have
        (256, 255, True),  # 8 warps x 8192 (255 x 32 rounded up to 256s): exactly the register file
        (512, 128, True),
        (512, 129, False),  # 16 warps x 4352 > 65536
        (512, 206, False),  # flash-tiling{block_q=256} without launch bounds
        (1024, 64, True),
        (1024, 65, False),
    ],
)
def test_blocks_are_checked_against_the_register_file(threads, registers, fits):
    from attncomp.backends.numba_cuda.host import launches

    assert (launches.block_registers(registers, threads) <= launches.REGISTER_FILE) == fits
    if fits:
        launches.check_block("attention_kernel_0", threads, registers)
        return
    with pytest.raises(launches.LaunchResourceError, match=rf"attention_kernel_0: a block of {threads} threads"):
        launches.check_block("attention_kernel_0", threads, registers)


def test_the_driver_limit_on_threads_is_checked_too():
    from attncomp.backends.numba_cuda.host import launches

    with pytest.raises(launches.LaunchResourceError, match="the driver allows 256 threads"):
        launches.check_block("k", 512, 32, max_threads=256)


def test_generated_kernels_carry_launch_bounds_outside_the_simulator():
    from attncomp.backends.numba_cuda.host import launches

    assert not launches.SIMULATED
    assert launches.jit_decorator(128) == "@cuda.jit(cache=True, launch_bounds=128)"


@pytest.mark.parametrize(
    "text,convergent,side_effect",
    [
        ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0, $1, $2, $3}, ...;", True, False),
        ("shfl.sync.bfly.b32 $0, $1, $2, 0x1f, 0xffffffff;", True, False),
        ("cvt.rn.bf16x2.f32 $0, $1, $2;", False, False),
        ("ex2.approx.ftz.f32 $0, $1;", False, False),
        ("ld.shared.v4.u32 {$0, $1, $2, $3}, [$4];", False, True),
        ("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {$0, $1, $2, $3}, [$4];", True, True),
        ("cp.async.cg.shared.global [$0], [$1], 16;", False, True),
        ("red.global.add.f32 [$0], $1;", False, True),
    ],
)
def test_inline_ptx_is_marked_by_what_it_does(text, convergent, side_effect):
    from llvmlite import ir

    from attncomp.backends.numba_cuda.mma.warp_ptx import asm_flags, call_asm

    assert asm_flags(text) == (convergent, side_effect)
    module = ir.Module()
    fnty = ir.FunctionType(ir.IntType(32), [ir.IntType(32)])
    function = ir.Function(module, fnty, "f")
    builder = ir.IRBuilder(function.append_basic_block())
    builder.ret(call_asm(builder, fnty, text, "=r,r", list(function.args)))
    (line,) = [line for line in str(module).splitlines() if " asm " in line]
    assert ("asm sideeffect" in line) == side_effect
    assert line.rstrip().endswith("convergent") == convergent


def test_a_launch_checks_its_block_before_it_runs(monkeypatch):
    """``launches.launch`` hands numba-cuda a pre-launch check: a compiled kernel whose registers times
    the block's threads pass the register file raises before the launch, with the kernel's name."""
    from attncomp.backends.numba_cuda.host import launches

    monkeypatch.setattr(launches, "_REGISTERS", [launches.REGISTER_FILE])
    launched = []

    def attention_kernel_0():
        pass

    class Compiled:  # what numba-cuda passes a callback: the compiled kernel, ptxas' registers known
        py_func = attention_kernel_0
        regs_per_thread = 206
        max_threads_per_block = 1024

    class Configured:
        def __init__(self, block):
            self.blockdim = (block, 1, 1)
            self.pre_launch_callbacks = []

        def __call__(self, *args):
            for callback in self.pre_launch_callbacks:
                callback(Compiled(), self)
            launched.append(args)

    class Dispatcher:
        def __getitem__(self, config):
            return Configured(config[1])

    launches.launch(Dispatcher(), 4, 256, "argument")  # 8 warps x 206 registers: 53248 of 65536
    assert launched == [("argument",)]
    with pytest.raises(launches.LaunchResourceError, match="attention_kernel_0: a block of 512 threads"):
        launches.launch(Dispatcher(), 4, 512, "argument")
    assert len(launched) == 1


class _CompileReached(Exception):
    """Raised by the stand-in for numba-cuda's compile: the launch got as far as compiling."""


def _dispatcher():
    """A numba-cuda dispatcher without a signature (as a generated module's kernels are), outside
    the simulator: its first launch compiles."""
    from numba import cuda

    @cuda.jit
    def add_one(a):
        i = cuda.grid(1)
        if i < a.size:
            a[i] += 1

    return add_one


def test_a_first_launch_compiles_in_the_window_holding_its_cache_entry(monkeypatch):
    """numba-cuda's launch path, run for real up to its compile (which needs a GPU after NVVM): the
    compile it calls for new argument types runs inside the compile window (collector paused, calls
    remembered) while this process holds the cache entry's lock, named by the kernel and its types."""
    import fcntl
    import gc

    import numpy as np

    from attncomp.backends import call_types
    from attncomp.backends.cache import cache_dir
    from attncomp.backends.numba_cuda.host import launch_compiles, launches

    kernel = _dispatcher()
    array = np.zeros(4, np.float32)
    name = launch_compiles.lock_name(kernel, (array,))
    assert "add_one" in name
    assert name != launch_compiles.lock_name(kernel, (np.zeros(4, np.float64),))
    seen = []

    def compile_(self, signature):
        entry = open(cache_dir() / "locks" / f"{name}.lock", "a")
        try:
            fcntl.flock(entry, fcntl.LOCK_EX | fcntl.LOCK_NB)
            locked = False
            fcntl.flock(entry, fcntl.LOCK_UN)
        except BlockingIOError:
            locked = True
        finally:
            entry.close()
        seen.append((signature, call_types.compiling(), gc.isenabled(), locked))
        raise _CompileReached

    monkeypatch.setattr(type(kernel), "compile", compile_)
    was_enabled = gc.isenabled()
    with pytest.raises(_CompileReached):
        launches.launch(kernel, 1, 32, array)
    assert seen == [((kernel.typeof_pyval(array),), True, False, True)]
    assert gc.isenabled() == was_enabled  # the window closed with the failed compile
    prepared = vars(kernel)[launch_compiles.MISS]
    launch_compiles.prepare(kernel)
    assert vars(kernel)[launch_compiles.MISS] is prepared  # once a dispatcher


@pytest.mark.filterwarnings("ignore:.*Grid size")
def test_numba_cudas_own_compile_runs_outside_the_window_without_it(monkeypatch):
    """The control of the test above: the same launch through numba-cuda alone compiles outside."""
    import gc

    import numpy as np

    from attncomp.backends import call_types

    kernel = _dispatcher()
    seen = []

    def compile_(self, signature):
        seen.append((call_types.compiling(), gc.isenabled()))
        raise _CompileReached

    monkeypatch.setattr(type(kernel), "compile", compile_)
    with pytest.raises(_CompileReached):
        kernel[1, 32](np.zeros(4, np.float32))
    assert seen == [(False, gc.isenabled())]


def test_small_grids_launch_without_numba_cudas_occupancy_warning(monkeypatch):
    """A one-block launch (a decoding step's append) warns in numba-cuda; through ``launches.launch``
    it does not, and other warnings still show."""
    import warnings

    import numpy as np

    from attncomp.backends.numba_cuda.host import launches

    kernel = _dispatcher()
    monkeypatch.setattr(type(kernel), "compile", lambda self, signature: (_ for _ in ()).throw(_CompileReached()))
    with warnings.catch_warnings(record=True) as direct:
        warnings.simplefilter("always")
        kernel[1, 32]
    if not any(issubclass(w.category, launches._performance_warning()) for w in direct):
        pytest.skip("this numba-cuda does not warn of small grids")
    with warnings.catch_warnings(record=True) as ours:
        warnings.simplefilter("always")
        with pytest.raises(_CompileReached):
            launches.launch(kernel, 1, 32, np.zeros(4, np.float32))
        warnings.warn("another warning", UserWarning, stacklevel=1)
    assert [str(w.message) for w in ours] == ["another warning"]
