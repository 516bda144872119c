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
from attncomp.ir.binding import bind_arguments, is_torch_tensor, refuse_grad
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


def tensor_patterns(args: Sequence[Any], names: Sequence[str]) -> list[Any]:
    """``args`` with each torch CUDA bf16 tensor as its 16-bit patterns (:class:`arrays.Bf16Bits` over an
    int16 view: the array interface has no bf16); a device tensor that requires grad is refused naming
    the argument (a call computes no gradient: ``fn.to_torch()`` does)."""
    given = list(args)
    for k, a in enumerate(given):
        if not is_torch_tensor(a) or not a.is_cuda:
            continue
        refuse_grad(a, names[k])
        if str(a.dtype) == "torch.bfloat16":
            import torch  # loaded already: a is one of its tensors

            given[k] = arrays.Bf16Bits(a.view(torch.int16))
    return given


#: argument keys a function's binding remembers (``seen``)
REMEMBERED_KEYS = 64


def bind_device_arguments(
    func: Func,
    args: Sequence[Any],
    constraints: Sequence[Any] = (),
    sizes: dict[str, int] | None = None,
    seen: dict[tuple, dict[str, int]] | None = None,
) -> tuple[list[Any], dict[str, int]]:
    """``bind_arguments`` for host or device arguments: the same checks and errors, no copies.

    ``seen`` remembers the sizes bound for each key of device-only arguments (each one's kind,
    element type and shape, and the caller's sizes): binding reads nothing else, so a later call with
    the same key takes them without the stand-ins and checks (a decode step's host time)."""
    on_device = [arrays.is_device(a) for a in args]
    views = [arrays.device_view(a) if device else a for a, device in zip(args, on_device)]
    key = None
    if seen is not None and all(on_device):
        key = (*[(type(a), a.dtype, tuple(a.shape)) for a in args], *sorted((sizes or {}).items()))
        env = seen.get(key)
        if env is not None:
            return views, dict(env)
    checked = [stand_in(v, declared(a)) if device else v for a, v, device in zip(args, views, on_device)]
    extra = {} if sizes is None else {"sizes": sizes}
    host, env = bind_arguments(func, checked, constraints, **extra)
    if key is not None and len(seen) < REMEMBERED_KEYS:
        seen[key] = dict(env)
    bound = [v if device else array for v, device, array in zip(views, on_device, host)]
    return bound, env
