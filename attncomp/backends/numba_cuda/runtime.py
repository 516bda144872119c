"""Helpers the generated CUDA driver calls: transfers, allocation, launch shapes, checks.

Values of rank >= 1 live on the device as Numba device arrays; 0-d values
(scales, sizes, constants) live on the host as numpy 0-d arrays and reach
kernels as scalar arguments.  Under Numba's CUDA simulator
(``NUMBA_ENABLE_CUDASIM=1``) every thread is a Python thread, so 1-d
launches use few threads and blocks there; the kernels loop grid-stride, so
the same code runs either way.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import numpy as np
from numba import cuda

from attncomp.backends.numba_cuda.warp import round_bf16, widen_bf16
from attncomp.backends.scalars import kernel_scalar  # noqa: F401 (generated drivers call rt.kernel_scalar)
from attncomp.errors import AttncompError, with_location
from attncomp.ir.ops.shape import check_pages as _check_pages
from attncomp.ir.ops.structural import check_index_range
from attncomp.ir.types import NUMPY_DTYPES

__all__ = ["check_index_range"]

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


@contextlib.contextmanager
def on_stream(cuda_stream: Any) -> Iterator[None]:
    """Run the calls inside on ``cuda_stream`` (a Numba stream, such as ``cuda.external_stream``
    over PyTorch's current stream); results copied to the host are waited for."""
    token = _STREAM.set(cuda_stream)
    try:
        yield
    finally:
        _STREAM.reset(token)


def copy_to_host(x: Any) -> np.ndarray:
    """A device array copied to the host on the current stream (waited for)."""
    out = x.copy_to_host(stream=stream())
    if stream() != 0:
        stream().synchronize()
    return out


def _simulated_array_type() -> type | None:
    if not SIMULATED:
        return None
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

    return FakeCUDAArray


class Bf16Bits:
    """bf16 device memory given as its 16-bit patterns: a uint16 or int16 device array (a torch
    bfloat16 CUDA tensor viewed as int16; the array interface has no bfloat16).  The argument
    checks see a bf16 array of its shape; kernels that keep bf16 in 16 bits read the patterns."""

    dtype = np.dtype(NUMPY_DTYPES["bf16"])

    def __init__(self, bits: Any):
        self.bits = bits

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.bits.shape)

    @property
    def ndim(self) -> int:
        return len(self.bits.shape)

    def __getitem__(self, index: Any) -> Bf16Bits:
        """A view of the patterns (a decoder's cache, up to its length)."""
        return Bf16Bits(self.bits[index])

    def copy_to_host(self) -> np.ndarray:
        """The values on the host, as ``ml_dtypes.bfloat16``."""
        return np.asarray(self.bits.copy_to_host()).view(np.uint16).view(self.dtype)

    def __repr__(self) -> str:
        return f"<bf16 device array {self.shape}>"


def is_device(x: Any) -> bool:
    """Whether ``x`` is device memory: anything with ``__cuda_array_interface__`` (Numba, CuPy,
    torch CUDA tensors), a simulator device array, or :class:`Bf16Bits` of one."""
    if isinstance(x, Bf16Bits):
        return True
    fake = _simulated_array_type()
    return hasattr(x, "__cuda_array_interface__") or (fake is not None and isinstance(x, fake))


def device_view(x: Any) -> Any:
    """A Numba device array over ``x``'s memory (no copy; :class:`Bf16Bits`: over its patterns, as
    uint16 whatever integer type they came as, so that kernels run the specialisation they are
    compiled and checked for: a torch bf16 tensor arrives as int16)."""
    if isinstance(x, Bf16Bits):
        bits = device_view(x.bits)
        return bits if bits.dtype == np.uint16 else bits.view(np.uint16)
    fake = _simulated_array_type()
    if fake is not None:
        return x
    if isinstance(x, cuda.cudadrv.devicearray.DeviceNDArray):
        return x
    return cuda.as_cuda_array(x)


#: the alignment of a 16-byte asynchronous copy's source
COPY_ALIGN = 16


def _device_address(x: Any) -> int | None:
    """The address of a device array's first element (the simulator's: its host array's)."""
    fake = _simulated_array_type()
    if fake is not None and isinstance(x, fake):
        return int(np.asarray(x).ctypes.data)  # the simulator's device array: a view of its host array
    pointer = getattr(x, "device_ctypes_pointer", None)
    return None if pointer is None else pointer.value


def dense_rows(x: Any) -> bool:
    """Whether a kernel may read ``x`` (a device view) a 16-byte chunk at a time as dense rows: the
    last axis contiguous, the rows one after another, every other stride and the first element
    16-byte aligned (a C-contiguous array, or a decoder cache's prefix of one)."""
    shape, strides = tuple(x.shape), tuple(x.strides)
    if len(shape) < 2 or 0 in shape:
        return False
    item = x.dtype.itemsize
    if (shape[-1] > 1 and strides[-1] != item) or (shape[-2] > 1 and strides[-2] != shape[-1] * item):
        return False
    if (shape[-1] * item) % COPY_ALIGN or any(s % COPY_ALIGN for n, s in zip(shape[:-2], strides[:-2]) if n > 1):
        return False
    address = _device_address(x)
    return address is not None and address % COPY_ALIGN == 0


def to_device(x: Any) -> Any:
    """An argument on the device: device memory as it is, host arrays copied in."""
    if is_device(x):
        return device_view(x)
    return cuda.to_device(np.ascontiguousarray(x), stream=stream())


def host_value(x: Any, dtype: str) -> np.ndarray:
    """A 0-d value on the host (copied back if it is on the device)."""
    if is_device(x):
        x = copy_to_host(device_view(x))
    return np.asarray(x, dtype=NUMPY_DTYPES[dtype]).reshape(())


def cast(x: Any, dtype: str) -> np.ndarray:
    return np.asarray(x, dtype=NUMPY_DTYPES[dtype])


def empty(shape: tuple[int, ...], dtype: Any) -> Any:
    """A device array; a 0-d result gets one element, read back with :func:`host_value`."""
    return cuda.device_array(shape or (1,), dtype=NUMPY_DTYPES.get(dtype, dtype), stream=stream())


def scratch(shape: tuple[int, ...], dtype: Any) -> Any:
    """An uninitialised device array of a numpy dtype (kernel workspace)."""
    return cuda.device_array(shape, dtype=dtype, stream=stream())


def fill_zero(array: Any) -> None:
    """Zero a device array (``cuda.device_array`` leaves it uninitialised)."""
    if array.size:
        array.copy_to_device(np.zeros(tuple(array.shape), dtype=array.dtype), stream=stream())


@cuda.jit
def _fill_zero_kernel(flat):
    for n in range(cuda.grid(1), flat.size, cuda.gridsize(1)):
        flat[n] = 0


@cuda.jit
def _copy_kernel(out, src):
    for n in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        out[n] = src[n]


@cuda.jit
def _widen_kernel(out, bits):
    for n in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        out[n] = widen_bf16(np.uint16(bits[n]))


@cuda.jit
def _round_kernel(bits, x):
    for n in range(cuda.grid(1), x.size, cuda.gridsize(1)):
        bits[n] = round_bf16(np.float32(x[n]))


def _contiguous(x: Any, name: str) -> Any:
    if not x.is_c_contiguous():
        raise TypeError(f"{name}: bf16 device memory is converted by a kernel that needs it C-contiguous, got a view")
    return x


def widen(x: Bf16Bits, name: str = "argument") -> Any:
    """bf16 patterns (``Bf16Bits``, C-contiguous) as a float32 device array of the same values, converted
    by a kernel on the current stream: what a kernel that reads the argument as float32 takes."""
    bits = _contiguous(device_view(x), name)
    out = cuda.device_array(tuple(bits.shape), dtype=np.float32, stream=stream())
    if out.size:
        launch_map(_widen_kernel, int(out.size), out.reshape(out.size), bits.reshape(bits.size))
    return out


def rounded(x: Any, name: str = "result") -> Bf16Bits:
    """A float32 device array (C-contiguous) rounded to bf16 by a kernel (to nearest even, NaN kept:
    ``warp.round_bf16``): its patterns, as ``Bf16Bits``."""
    values = _contiguous(x, name)
    bits = cuda.device_array(tuple(values.shape), dtype=np.uint16, stream=stream())
    if bits.size:
        launch_map(_round_kernel, int(bits.size), bits.reshape(bits.size), values.reshape(values.size))
    return Bf16Bits(bits)


def zeros(shape: tuple[int, ...], dtype: Any) -> Any:
    """A zeroed device array (zeroed by a kernel: no host transfer); 0-d gets one element, as in
    :func:`empty`.  What the backward's kernels and ``ac.scatter_add`` add into."""
    array = empty(shape, dtype)
    if array.size:
        launch_map(_fill_zero_kernel, int(array.size), array.reshape(array.size))
    return array


def narrow(x: Any, dtype: str) -> Any:
    """``x`` (a C-contiguous device array) in ``dtype``: itself when it already is, else a converted copy
    (atomics add in float32; a float16 result is narrowed after)."""
    want = np.dtype(NUMPY_DTYPES[dtype])
    if x.dtype == want:
        return x
    out = cuda.device_array(tuple(x.shape), dtype=want, stream=stream())
    if out.size:
        launch_map(_copy_kernel, int(out.size), out.reshape(out.size), x.reshape(x.size))
    return out


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


def from_host(x: Any, shape: tuple[int, ...]) -> Any:
    return cuda.to_device(np.ascontiguousarray(np.reshape(x, shape)), stream=stream())


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
    name = getattr(getattr(kernel, "py_func", None), "__name__", "kernel")
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


def launch(kernel, grid: Any, block: Any, *args: Any) -> None:
    """Enqueue ``kernel`` on the current stream (every launch goes through here, and is counted).  On
    a GPU the block is first checked against the register file (:func:`check_block`)."""
    _LAUNCHES[0] += 1
    configured = kernel[grid, block, stream()]
    callbacks = None if SIMULATED else getattr(configured, "pre_launch_callbacks", None)
    if callbacks is not None:
        _register_file()  # read here: the callback makes no driver calls of its own
        callbacks.append(_register_check)
    configured(*args)


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


def gather_flags(n_axes: int) -> Any:
    """Per index axis: a flag and an offending index, set by a gather kernel."""
    return cuda.to_device(np.zeros(2 * n_axes, dtype=np.int64), stream=stream())


def check_indices(flags: Any, shape: tuple[int, ...], at: str = "") -> None:
    """The interpreter's ``IndexError`` if a gather or scatter_add kernel saw an index out of range: per
    axis, the kernel keeps the lowest negative index and the highest one past the end (0 when none)."""
    found = copy_to_host(flags)
    for axis in range(len(found) // 2):
        low, high = int(found[2 * axis]), int(found[2 * axis + 1])
        if low < 0 or high >= shape[axis]:
            bad = low if low < 0 else high
            message = f"ac.gather: index {bad} is out of range for axis {axis} of size {shape[axis]}"
            raise IndexError(with_location(message, at))


def check_pages(table: Any, num_pages: int, size: int, rows: int) -> None:
    """Before a kernel reads ``rows`` rows through a page table: enough entries, each naming a page
    (a table already on the device is copied back to be checked: tables are small)."""
    host = copy_to_host(device_view(table)) if is_device(table) else table
    _check_pages(np.asarray(host, dtype=np.int64), num_pages, size, rows)


def is_contiguous(x: Any) -> bool:
    return bool(x.is_c_contiguous())


def prefix(x: Any, axis: int, stop: int) -> Any:
    """The view ``x[..., :stop, ...]`` along ``axis``."""
    index = [slice(None)] * x.ndim
    index[axis] = slice(0, stop)
    return x[tuple(index)]


def result(x: Any, dtype: str, to_host: bool) -> Any:
    """A function result: a device array (or copied to the host), or a 0-d host value."""
    if is_device(x):
        return copy_to_host(device_view(x)) if to_host else x
    return np.asarray(x, dtype=NUMPY_DTYPES[dtype])
