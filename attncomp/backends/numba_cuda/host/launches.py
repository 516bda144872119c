"""Kernel launches from the host: streams, launch shapes, the register-file check, the count.

Every launch goes through :func:`launch`, on the current call's stream (:func:`on_stream`).  Under
Numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``) every thread is a Python thread, so 1-d
launches use few threads and blocks there; the kernels loop grid-stride, so the same code runs
either way.  Generated drivers reach these as ``rt.*`` (``numba_cuda/runtime.py``).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from numba import cuda

from attncomp.backends.numba_cuda.host import launch_compiles, launch_times
from attncomp.errors import AttncompError

SIMULATED = bool(getattr(cuda.config, "ENABLE_CUDASIM", 0))
#: threads per block and the most blocks of a 1-d (grid-stride) launch; the most batch
#: blocks of a matmul (its kernel loops over the rest); the side of a matmul's square tile.
#: The simulator runs every thread as a Python thread: fewer threads, each doing more, run
#: faster there, and the kernels' code is the same apart from these constants.
THREADS, MAX_BLOCKS, MAX_GRID_Z = (8, 1, 2) if SIMULATED else (256, 8192, 65535)
MATMUL_TILE = 8 if SIMULATED else 16


#: the stream every launch, allocation and copy of a call is enqueued on (0: Numba's default)
_STREAM: contextvars.ContextVar[Any] = contextvars.ContextVar("attncomp_cuda_stream", default=0)


def stream() -> Any:
    """The stream of the current call: 0 (the default stream) unless :func:`on_stream` set one."""
    return _STREAM.get()


def stream_key() -> int:
    """The current stream as a number: its handle (0, or a flag, for a default stream); under the
    simulator, whose streams have none, the stream object's identity."""
    current = stream()
    try:
        return int(current)
    except TypeError:
        return id(current)


#: where the current call's device memory comes from (None: Numba's allocations); see :func:`on_stream`
_ALLOCATE: contextvars.ContextVar[Callable[[tuple[int, ...], np.dtype], Any] | None] = contextvars.ContextVar(
    "attncomp_cuda_allocate", default=None
)


def allocator() -> Callable[[tuple[int, ...], np.dtype], Any] | None:
    """The current call's allocator (:func:`on_stream`'s ``allocate``), or None."""
    return _ALLOCATE.get()


@contextlib.contextmanager
def on_stream(cuda_stream: Any, allocate: Callable[[tuple[int, ...], np.dtype], Any] | None = None) -> Iterator[None]:
    """Run the calls inside on ``cuda_stream`` (a Numba stream, such as ``cuda.external_stream``
    over PyTorch's current stream); results copied to the host are waited for.  ``allocate(shape,
    dtype)``: where the calls' device memory comes from (another library's allocator, on that
    stream: device memory with the array interface, or None to leave one to Numba)."""
    tokens = _STREAM.set(cuda_stream), _ALLOCATE.set(allocate)
    try:
        yield
    finally:
        _ALLOCATE.reset(tokens[1])
        _STREAM.reset(tokens[0])


_MULTIPROCESSORS: list[int] = []


def multiprocessors() -> int:
    """The current GPU's streaming multiprocessors (1 under the simulator)."""
    if not _MULTIPROCESSORS:
        count = 1
        if not SIMULATED:
            count = int(cuda.get_current_device().MULTIPROCESSOR_COUNT)
        _MULTIPROCESSORS.append(count)
    return _MULTIPROCESSORS[0]


def resident_blocks(threads: int) -> int:
    """Thread blocks of ``threads`` threads that keep the GPU busy: a launch with fewer splits its
    keys (flash-decoding).  Up to 16 blocks, or 1024 threads, per multiprocessor; 4 blocks under
    the simulator, where every block runs in turn."""
    if SIMULATED:
        return 4
    return multiprocessors() * max(1, min(16, 1024 // max(threads, 1)))


def work(array: Any, axis: int | None = None) -> int:
    """Iterations of a 1-d kernel: the elements of ``array``, or its rows along ``axis``."""
    if axis is None:
        return int(array.size)
    n = array.shape[axis]
    return int(array.size // n) if n else 0


#: kernel launches enqueued by attncomp since the process started (:func:`launch_count`)
_LAUNCHES = [0]


def launch_count() -> int:
    """How many kernels attncomp has launched so far: the difference over a call is that call's
    launches (``benchmarks.gpu`` reports a decoder step's)."""
    return _LAUNCHES[0]


#: 32-bit registers one thread block may use (and a multiprocessor holds) on sm_80 and sm_90
REGISTER_FILE = 65536
#: registers are given to a warp in units of this many
REGISTER_UNIT = 256


class LaunchResourceError(AttncompError, RuntimeError):
    """A kernel's thread block needs more registers than a multiprocessor has: it could not launch."""


def block_registers(registers: int, threads: int) -> int:
    """The registers a thread block of ``threads`` threads at ``registers`` each takes: per warp,
    32 threads' registers rounded up to the allocation unit."""
    warps = -(-threads // 32)
    return warps * -(-registers * 32 // REGISTER_UNIT) * REGISTER_UNIT


def check_block(
    name: str, threads: int, registers: int, max_threads: int | None = None, register_file: int = REGISTER_FILE
) -> None:
    """Raise :class:`LaunchResourceError` unless a block of ``threads`` threads of a kernel that uses
    ``registers`` registers a thread fits a multiprocessor's ``register_file`` (and the driver's
    ``max_threads`` for the kernel, where known): the launch would fail with an out-of-resources error."""
    need = block_registers(registers, threads)
    if need <= register_file and (max_threads is None or threads <= max_threads):
        return
    raise LaunchResourceError(
        f"{name}: a block of {threads} threads ({-(-threads // 32)} warps) x {registers} registers needs {need} "
        f"registers, more than the {register_file} of a multiprocessor"
        + (f" (the driver allows {max_threads} threads of this kernel)" if max_threads is not None else "")
        + "; choose smaller blocks (flash-tiling{block_q=...,block_k=...}) or a smaller head dim"
    )


def jit_decorator(threads: int) -> str:
    """The decorator line of a generated kernel launched with blocks of ``threads`` threads: its
    ``launch_bounds`` tell ptxas the block size, so registers x threads stays within a multiprocessor's
    register file (spilling, if it must, rather than failing at launch).  Under the simulator, whose
    ``cuda.jit`` takes no launch bounds, without them."""
    return "@cuda.jit(cache=True)" if SIMULATED else f"@cuda.jit(cache=True, launch_bounds={threads})"


_CHECKED: set[tuple[int, int]] = set()  # (id of a compiled kernel, threads) found to fit


def _register_check(kernel: Any, config: Any) -> None:
    """Before a launch (numba-cuda's pre-launch callback): the block fits the register file.  Each
    compiled kernel and block size is checked once (its attributes are read when it is loaded)."""
    block = config.blockdim
    threads = int(np.prod(block)) if isinstance(block, tuple) else int(block)
    key = (id(kernel), threads)
    if key in _CHECKED:
        return
    name = launch_times.kernel_name(kernel)
    check_block(name, threads, int(kernel.regs_per_thread), int(kernel.max_threads_per_block), _register_file())
    _CHECKED.add(key)


_REGISTERS: list[int] = []


def _register_file() -> int:
    """The current GPU's registers per block (``REGISTER_FILE`` where the driver does not say)."""
    if not _REGISTERS:
        try:
            _REGISTERS.append(int(cuda.get_current_device().MAX_REGISTERS_PER_BLOCK))
        except Exception:  # an attribute this driver binding lacks
            _REGISTERS.append(REGISTER_FILE)
    return _REGISTERS[0]


#: numba-cuda warns of every launch of fewer blocks than this (``CUDA_LOW_OCCUPANCY_WARNINGS``)
FEW_BLOCKS = 128


def launch(kernel, grid: Any, block: Any, *args: Any) -> None:
    """Enqueue ``kernel`` on the current stream (every launch goes through here, and is counted).  On
    a GPU the block is first checked against the register file (:func:`check_block`), a compile the
    launch needs runs in the compile window (``launch_compiles.py``), and numba-cuda's warning of a
    small grid is left out: attncomp sizes its grids to the work (a decoding step's append of one
    position is one block), and the warning, once per process, would speak of no code of the user's.
    Inside ``launch_times.launch_times()`` the launch is recorded, with its host and stream times."""
    _LAUNCHES[0] += 1
    if SIMULATED:
        configured = kernel[grid, block, stream()]
    else:
        launch_compiles.prepare(kernel)
        configured = _configured(kernel, grid, block)
    callbacks = None if SIMULATED else getattr(configured, "pre_launch_callbacks", None)
    if callbacks is not None:
        _register_file()  # read here: the callback makes no driver calls of its own
        callbacks.append(_register_check)
    records = launch_times.recording()
    if records is None:
        configured(*args)
    else:
        name = launch_times.kernel_name(kernel)
        launch_times.timed(records, name, grid, block, lambda: configured(*args), SIMULATED, stream())


def _configured(kernel, grid: Any, block: Any) -> Any:
    """``kernel[grid, block, stream()]``, numba-cuda's low-occupancy warning ignored for a small grid
    (``warnings.catch_warnings``, only then: it costs a few microseconds)."""
    blocks = math.prod(grid) if isinstance(grid, tuple) else int(grid)
    if blocks >= FEW_BLOCKS:
        return kernel[grid, block, stream()]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", _performance_warning())
        return kernel[grid, block, stream()]


@functools.cache
def _performance_warning() -> type[Warning]:
    """numba-cuda's performance warning class (``numba.cuda.core.errors``; Numba's own in older ones)."""
    try:
        from numba.cuda.core.errors import NumbaPerformanceWarning
    except ImportError:
        from numba.core.errors import NumbaPerformanceWarning
    return NumbaPerformanceWarning


def launch_map(kernel, count: int, *args: Any) -> None:
    if count <= 0:
        return
    launch(kernel, min(-(-count // THREADS), MAX_BLOCKS), THREADS, *args)


def launch_matmul(kernel, out: Any, *args: Any) -> None:
    shape = tuple(out.shape)  # the simulator's shapes take no negative indices
    m, n = shape[-2], shape[-1]
    batch = int(np.prod(shape[:-2], dtype=np.int64))
    if m == 0 or n == 0 or batch == 0:
        return
    grid = (-(-n // MATMUL_TILE), -(-m // MATMUL_TILE), min(batch, MAX_GRID_Z))
    launch(kernel, grid, (MATMUL_TILE, MATMUL_TILE), out, *args)
