"""Numba's CUDA simulator with memory that is never silently right by chance.

The simulator hands out shared, local and device arrays from ``np.empty``: memory a
kernel reads before writing then holds whatever the allocator had there, often the
right value left by an earlier launch, so a missing store passes one run and fails
the next.  Here every such array starts poisoned (NaN in floating types, the
largest value in integer ones, which reads as NaN in bf16 and f32 bit patterns and
is out of range as an index), so a read of memory no thread wrote fails every run.

It also makes the simulator's shared-array lookup atomic: the simulator finds a
block's shared array by the line that declares it and creates it on the first
call, without a lock, so a thread switch between the lookup and the store gives two
threads of the first block different arrays.  It reads the declaring line from the
caller's frame, not from ``traceback.extract_stack`` (which reads the source of
every frame), which takes a third off the simulator suite's time.
"""

from __future__ import annotations

import sys
import threading

import numpy as np


def poison(array: np.ndarray) -> np.ndarray:
    """Fill ``array`` with its type's poison value (NaN, or the largest integer) and return it."""
    kind = array.dtype.kind
    if kind == "f":
        array.fill(np.nan)
    elif kind in "iu":
        array.fill(np.iinfo(array.dtype).max)
    elif kind == "b":
        array.fill(True)
    return array


def install() -> None:
    """Poison the simulator's new shared, local and device arrays; lock its shared-array lookup."""
    from numba.core import types
    from numba.cuda.simulator import kernelapi
    from numba.cuda.simulator.cudadrv import devicearray
    from numba.np import numpy_support

    lock = threading.Lock()

    def shared_array(self, shape, dtype, alignment=None):
        if alignment is not None:
            raise RuntimeError("Array alignment is not supported in cudasim")
        if isinstance(dtype, types.Type):
            dtype = numpy_support.as_dtype(dtype)
        if shape == 0:  # dynamic shared memory: one buffer for every declaration
            return np.frombuffer(self._dynshared.data, dtype=dtype, count=self._dynshared_size // dtype.itemsize)
        frame = sys._getframe(1)  # the declaring line, as the simulator keys it
        caller = (frame.f_code.co_filename, frame.f_lineno)
        with lock:
            array = self._allocations.get(caller)
            if array is None:
                array = self._allocations[caller] = poison(np.empty(shape, dtype))
        return array

    local_array = kernelapi.FakeCUDALocal.array

    def poisoned_local_array(self, shape, dtype, alignment=None):
        return poison(local_array(self, shape, dtype, alignment))

    device_array = devicearray.device_array

    def poisoned_device_array(*args, **kwargs):
        array = device_array(*args, **kwargs)
        poison(array._ary)
        return array

    kernelapi.FakeCUDAShared.array = shared_array
    kernelapi.FakeCUDALocal.array = poisoned_local_array
    devicearray.device_array = poisoned_device_array
    import numba.cuda

    numba.cuda.device_array = poisoned_device_array
