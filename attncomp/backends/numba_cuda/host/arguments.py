"""Binding call arguments that may live on the GPU.

The shared binding code checks element types and shapes of numpy arrays.  A
device argument (``__cuda_array_interface__``: Numba device arrays, CuPy,
torch CUDA tensors) is checked through a zero-stride numpy stand-in of its
shape and dtype, so it is never copied to the host, and is then passed on as
a Numba view of the same memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from attncomp.backends.numba_cuda.host import arrays
from attncomp.ir.binding import bind_arguments
from attncomp.ir.core import Func


def stand_in(device: Any, dtype: Any = None) -> np.ndarray:
    """A numpy array with ``device``'s shape and dtype (or ``dtype``) that owns one element."""
    # broadcast, not as_strided: the array interface as_strided goes through names float8_e5m2 "<f1",
    # which numpy does not read back
    return np.broadcast_to(np.zeros((), dtype=device.dtype if dtype is None else dtype), tuple(device.shape))


def declared(x: Any) -> np.dtype | None:
    """The element type a device argument stands for, where its memory's type is not it (bf16 bits,
    8-bit codes)."""
    return x.dtype if isinstance(x, (arrays.Bf16Bits, arrays.CacheCodes)) else None


def bind_device_arguments(
    func: Func, args: Sequence[Any], constraints: Sequence[Any] = (), sizes: dict[str, int] | None = None
) -> tuple[list[Any], dict[str, int]]:
    """``bind_arguments`` for host or device arguments: the same checks and errors, no copies."""
    views = [arrays.device_view(a) if arrays.is_device(a) else a for a in args]
    checked = [stand_in(v, declared(a)) if arrays.is_device(a) else v for a, v in zip(args, views)]
    extra = {} if sizes is None else {"sizes": sizes}
    host, env = bind_arguments(func, checked, constraints, **extra)
    bound = [v if arrays.is_device(a) else array for a, v, array in zip(args, views, host)]
    return bound, env
