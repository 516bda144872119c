"""Device memory on the host side: transfers, allocation, bf16 patterns and their conversions, checks.

Values of rank >= 1 live on the device as Numba device arrays; 0-d values (scales, sizes,
constants) live on the host as numpy 0-d arrays and reach kernels as scalar arguments.  bf16
device memory may come as its 16-bit patterns (:class:`Bf16Bits`), converted by small kernels
(:func:`widen`, :func:`rounded`).  Generated drivers reach these as ``rt.*`` (``numba_cuda/runtime.py``).
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
from numba import cuda
from numba.cuda.cudadrv import driver

from attncomp.backends.numba_cuda.host.launches import SIMULATED, allocator, launch_map, stream
from attncomp.backends.numba_cuda.warp import round_bf16, widen_bf16
from attncomp.errors import with_location
from attncomp.ir.ops.shape import check_pages as _check_pages
from attncomp.ir.types import NUMPY_DTYPES


def device_dtype(dtype: Any) -> np.dtype:
    """The dtype device memory holds for ``dtype``: bf16 as float32 (see ``widen-bf16``)."""
    dtype = np.dtype(dtype)
    return np.dtype(np.float32) if dtype == np.dtype(NUMPY_DTYPES["bf16"]) else dtype


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


class DevicePatterns:
    """Device memory of an element type the array interface lacks, given as its bit patterns: an
    unsigned (or, from torch, signed) integer device array of the type's width.  The argument
    checks see an array of ``dtype`` and its shape; the kernels read and write the patterns."""

    dtype: np.dtype

    def __init__(self, bits: Any):
        self.bits = bits

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.bits.shape)

    @property
    def ndim(self) -> int:
        return len(self.bits.shape)

    @property
    def nbytes(self) -> int:
        return int(self.bits.size) * self.dtype.itemsize

    def __getitem__(self, index: Any) -> DevicePatterns:
        """A view of the patterns (a decoder's cache, up to its length)."""
        view = copy.copy(self)
        view.bits = sliced(self.bits, index)
        return view

    def copy_to_host(self) -> np.ndarray:
        """The values on the host, as their ``ml_dtypes`` type."""
        return np.asarray(self.bits.copy_to_host()).view(self.dtype)

    def __repr__(self) -> str:
        return f"<{self.dtype.name} device array {self.shape}>"


class Bf16Bits(DevicePatterns):
    """bf16 device memory as its 16-bit patterns: a uint16 or int16 device array (a torch bfloat16
    CUDA tensor viewed as int16; the array interface has no bfloat16).  Kernels that keep bf16 in
    16 bits read the patterns."""

    dtype = np.dtype(NUMPY_DTYPES["bf16"])

    def __repr__(self) -> str:
        return f"<bf16 device array {self.shape}>"


class CacheCodes(DevicePatterns):
    """A decoder's 8-bit cache in device memory: a uint8 device array of ``f8e4m3`` or ``f8e5m2``
    codes (the array interface has no 8-bit floats); the kernels read and write the bytes
    (``fp8_codes``)."""

    def __init__(self, bits: Any, dtype: Any):
        super().__init__(bits)
        self.dtype = np.dtype(dtype)


def is_device(x: Any) -> bool:
    """Whether ``x`` is device memory: anything with ``__cuda_array_interface__`` (Numba, CuPy,
    torch CUDA tensors), a simulator device array, or :class:`Bf16Bits` of one."""
    if type(x) is np.ndarray:
        return False
    if isinstance(x, DevicePatterns):
        return True
    fake = _simulated_array_type()
    if isinstance(x, fake or cuda.cudadrv.devicearray.DeviceNDArray):
        return True
    # a torch CUDA tensor says so without building its array interface (a dict, each time it is asked)
    return getattr(x, "is_cuda", False) is True or hasattr(x, "__cuda_array_interface__")


def device_view(x: Any) -> Any:
    """A Numba device array over ``x``'s memory (no copy; :class:`Bf16Bits`: over its patterns, as
    uint16 whatever integer type they came as, so that kernels run the specialisation they are
    compiled and checked for: a torch bf16 tensor arrives as int16)."""
    if isinstance(x, Bf16Bits):
        bits = device_view(x.bits)
        return bits if bits.dtype == np.uint16 else bits.view(np.uint16)
    if isinstance(x, CacheCodes):
        return device_view(x.bits)
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
    return _chunked_rows(x, lambda rows, pitch, row: rows == 1 or pitch == row)


def pitched_rows(x: Any) -> bool:
    """Whether a kernel may read ``x`` (a device view) a 16-byte chunk at a time as rows a pitch apart
    (:func:`dense_rows` but for the rows' stride, any 16-byte multiple at least a row long:
    FlashAttention's ``[B, T, H, D]`` read as ``[B, H, T, D]``, a head's rows ``H * D`` apart), with
    a head's rows times the pitch fewer than 2^31 elements (the copies' 32-bit offsets)."""
    limit = x.dtype.itemsize << 31
    return _chunked_rows(x, lambda rows, pitch, row: pitch % COPY_ALIGN == 0 and row <= pitch and rows * pitch < limit)


def _chunked_rows(x: Any, rows_apart: Any) -> bool:
    """Whether ``x`` has rows of 16-byte chunks (the last axis contiguous, a 16-byte multiple long),
    ``rows_apart(rows, pitch, row bytes)`` of its rows' count and stride, every other stride and
    the first element 16-byte aligned."""
    shape, strides = tuple(x.shape), tuple(x.strides)
    if len(shape) < 2 or 0 in shape:
        return False
    item = x.dtype.itemsize
    row = shape[-1] * item
    if (shape[-1] > 1 and strides[-1] != item) or row % COPY_ALIGN or not rows_apart(shape[-2], strides[-2], row):
        return False
    if any(s % COPY_ALIGN for n, s in zip(shape[:-2], strides[:-2]) if n > 1):
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


def allocate(shape: tuple[int, ...], dtype: Any) -> Any:
    """An uninitialised C-contiguous device array: every allocation of a call's results and workspace
    goes through here.  From the call's allocator where it has one (``launches.on_stream``'s
    ``allocate``: another library's memory, such as PyTorch's caching allocator, viewed in place),
    else Numba's (``cuda.device_array``, on the call's stream)."""
    shape, dtype = tuple(int(n) for n in shape), np.dtype(dtype)
    hook = allocator()
    given = hook(shape, dtype) if hook is not None and 0 not in shape else None
    if given is None:
        return cuda.device_array(shape, dtype=dtype, stream=stream())
    array = device_view(given)
    if tuple(array.shape) != shape or not array.is_c_contiguous() or array.dtype.itemsize != dtype.itemsize:
        raise ValueError(f"the call's allocator gave {array.shape} of {array.dtype} for {shape} of {dtype}")
    return array if array.dtype == dtype else array.view(dtype)  # a torch int16 tensor for uint16 patterns


def empty(shape: tuple[int, ...], dtype: Any) -> Any:
    """A device array; a 0-d result gets one element, read back with :func:`host_value`."""
    return allocate(shape or (1,), NUMPY_DTYPES.get(dtype, dtype))


def scratch(shape: tuple[int, ...], dtype: Any) -> Any:
    """An uninitialised device array of a numpy dtype (kernel workspace)."""
    return allocate(shape, dtype)


def fill_zero(array: Any) -> None:
    """Zero a C-contiguous device array (``cuda.device_array`` leaves it uninitialised) by a memset on
    the call's stream: a decoder's cache of 8,192 positions of 8 heads of 128 floats is 32 MiB that a
    copy of zeros would first make on the host and then move."""
    if array.size:
        driver.device_memset(array, 0, int(array.nbytes), stream=stream())


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
    out = allocate(tuple(bits.shape), np.float32)
    if out.size:
        launch_map(_widen_kernel, int(out.size), out.reshape(out.size), bits.reshape(bits.size))
    return out


def rounded(x: Any, name: str = "result") -> Bf16Bits:
    """A float32 device array (C-contiguous) rounded to bf16 by a kernel (to nearest even, NaN kept:
    ``warp.round_bf16``): its patterns, as ``Bf16Bits``."""
    values = _contiguous(x, name)
    bits = allocate(tuple(values.shape), np.uint16)
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
    out = allocate(tuple(x.shape), want)
    if out.size:
        launch_map(_copy_kernel, int(out.size), out.reshape(out.size), x.reshape(x.size))
    return out


def from_host(x: Any, shape: tuple[int, ...]) -> Any:
    return cuda.to_device(np.ascontiguousarray(np.reshape(x, shape)), stream=stream())


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
    """The view ``x[..., :stop, ...]`` along ``axis`` (a decoder's cache up to its length, each step)."""
    index = [slice(None)] * x.ndim
    index[axis] = slice(0, stop)
    return sliced(x, tuple(index))


def sliced(x: Any, index: Any) -> Any:
    """``x[index]`` for slices: a Numba device array's view made as Numba makes it, over the memory
    from its first element to its last (``gpu_data.view`` of the view's extent), without Numba's
    ``__getitem__`` listing every contiguous run of the view first (it keeps the list only to see
    whether it has one): a cache of 8 heads of 128 features viewed up to 4,000 of its 4,096
    positions is 32,000 runs, 23 ms of Python a view.  Other arrays (the simulator's, numpy's, bit
    patterns) are indexed as they are."""
    items = index if isinstance(index, tuple) else (index,)
    if (
        SIMULATED
        or type(x) is not cuda.cudadrv.devicearray.DeviceNDArray
        or not all(isinstance(i, slice) for i in items)
    ):
        return x[index]
    view = x._dummy[index]  # numba-cuda's shape-and-strides model of the array: a view of it is O(ndim)
    start, stop = view.extent
    return type(x)(
        shape=view.shape, strides=view.strides, dtype=x.dtype, gpu_data=x.gpu_data.view(start, stop), stream=x.stream
    )


def transposed(x: Any, perm: tuple[int, ...]) -> Any:
    """``x`` with its axes permuted, a view (nothing copied): a Numba device array's made from its shape
    and strides over the same memory, the simulator's by its own ``transpose``; bit patterns' as their
    integer array (``device_view``: bf16 as uint16, which the kernels reading patterns take)."""
    x = device_view(x)
    if SIMULATED or type(x) is not cuda.cudadrv.devicearray.DeviceNDArray:
        return x.transpose(perm)
    shape, strides = (tuple(t[p] for p in perm) for t in (x.shape, x.strides))
    return type(x)(shape=shape, strides=strides, dtype=x.dtype, gpu_data=x.gpu_data, stream=x.stream)


def result(x: Any, dtype: str, to_host: bool) -> Any:
    """A function result: a device array (or copied to the host), or a 0-d host value."""
    if is_device(x):
        return copy_to_host(device_view(x)) if to_host else x
    return np.asarray(x, dtype=NUMPY_DTYPES[dtype])
