"""Tensors as the arrays a program reads, its results back as tensors, and the checks naming an argument.

CPU tensors cross into numpy without copies (:func:`numpy_views`: a strided one made contiguous
once, bf16 through a 16-bit view, since numpy knows bfloat16 only as ml_dtypes'), and results are
wrapped the same way (:func:`wrap`), each owning its memory (:func:`owned`).  Tensors on a device
whose memory a program reads in place (``Program.device_type``) go as they are, on PyTorch's
current stream (:func:`run_in_place`).  Which of the two a call takes is the program's
``device_type``, never the backend's name.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from attncomp.ir.binding import check_dtype
from attncomp.ir.types import NUMPY_DTYPES

if TYPE_CHECKING:
    import torch

    from attncomp.backends.base import Program
    from attncomp.compilation import Compilation

BF16 = np.dtype(NUMPY_DTYPES["bf16"])


# checks: the binding's errors, naming the argument -------------------------------------------
def check_device(
    name: str, device: torch.device, program: Program, *, allow_meta: bool = False, scalar: bool = False
) -> None:
    """Raise ``ValueError`` naming the argument if ``device`` is not where ``program`` reads tensors
    (``Program.device_type``).  ``allow_meta``: the fake (shape-only) functions also serve meta tensors;
    ``scalar``: the tensor is 0-d, and a CPU one goes by value to any device, as PyTorch's CPU scalars do."""
    want = program.device_type
    if device.type == want or (allow_meta and device.type == "meta") or (scalar and device.type == "cpu"):
        return
    raise ValueError(
        f"{name}: a {device.type} tensor, but this function runs on the {program.backend!r} backend, "
        f"which takes {want} tensors (move it with .to({want!r}))"
    )


def numpy_dtype(tensor: torch.Tensor, want: str, name: str) -> np.dtype:
    """The numpy dtype of ``tensor``'s elements; a dtype numpy lacks is the binding's ``TypeError``."""
    try:
        return np.dtype(str(tensor.dtype).removeprefix("torch."))
    except TypeError:
        raise TypeError(
            f"{name}: expected {want} ({np.dtype(NUMPY_DTYPES[want]).name}) elements, "
            f"got {str(tensor.dtype).removeprefix('torch.')}"
        ) from None


def check_dtypes(compiled: Compilation, tensors: Sequence[torch.Tensor]) -> None:
    """Each tensor's dtype against ``compiled``'s arguments: the binding's ``TypeError`` naming the
    argument, before any conversion (``.numpy()`` refuses some dtypes itself)."""
    for k, (t, arg) in enumerate(zip(tensors, compiled.func.args)):
        name = arg.name or f"arg{k}"
        check_dtype(np.empty(0, numpy_dtype(t, arg.type.dtype, name)), arg.type.dtype, name)


def torch_dtype(torch: Any, dtype: str) -> Any:
    """The torch dtype of an IR element type ("f32" -> ``torch.float32``, "bf16" -> ``torch.bfloat16``)."""
    return getattr(torch, np.dtype(NUMPY_DTYPES[dtype]).name)


def crosses_bf16(compiled: Compilation) -> bool:
    """Whether any argument or result of ``compiled`` is bf16 (read and wrapped as 16-bit views)."""
    return any(v.type.dtype == "bf16" for v in (*compiled.func.args, *compiled.func.results))


# host memory: numpy views ---------------------------------------------------------------------
def numpy_views(torch: Any, tensors: Sequence[torch.Tensor], bf16: bool) -> list[np.ndarray]:
    """CPU ``tensors`` as C-contiguous numpy arrays sharing their memory (a strided one copied by
    torch, faster than numpy's copy; bf16 through a 16-bit view when ``bf16``)."""
    if not bf16:  # .numpy() refuses tensors that require grad
        return [(t.detach() if t.requires_grad else t).contiguous().numpy() for t in tensors]
    arrays = []
    for t in tensors:
        if t.requires_grad:
            t = t.detach()
        if not t.is_contiguous():
            t = t.contiguous()
        arrays.append(t.view(torch.int16).numpy().view(BF16) if t.dtype is torch.bfloat16 else t.numpy())
    return arrays


def from_numpy(torch: Any, a: np.ndarray) -> torch.Tensor:
    """A numpy array as a CPU tensor sharing its memory (bfloat16 through a 16-bit view)."""
    if a.dtype == BF16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def wrap(torch: Any, arrays: Sequence[np.ndarray], bf16: bool) -> list:
    """Arrays as CPU tensors sharing their memory (``bf16``: whether one may be bf16)."""
    if not bf16:
        return [torch.from_numpy(a) for a in arrays]
    return [from_numpy(torch, a) for a in arrays]


def owned(outputs: Sequence[np.ndarray], inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
    """``outputs``, each writable, contiguous and sharing memory with no input and no other output.

    A custom op's outputs must not alias its inputs or each other; a spec that returns an argument
    as it is (or a backward whose gradient is a cotangent) would otherwise hand one buffer out twice.
    """
    kept: list[np.ndarray] = []
    for out in outputs:
        if out.base is None and all([out is not o for o in kept]):
            flags = out.flags
            if flags.c_contiguous and flags.writeable:
                kept.append(out)  # a buffer the call allocated: no input or other output is in it
                continue
        shared = any(np.may_share_memory(out, other) for other in (*inputs, *kept))
        if shared or not (out.flags.writeable and out.flags.c_contiguous):
            out = np.array(out, order="C", copy=True)
        kept.append(out)
    return kept


def copy_to_save(t: torch.Tensor) -> torch.Tensor:
    """A strided tensor's contiguous copy, to run on and keep for the backward; an expanded one
    (a zero stride: GQA's ``k.expand(...)``) as it is, whose copy would hold more than the view."""
    return t if 0 in t.stride() else t.contiguous()


def run_on_host(
    torch: Any, compiled: Compilation, tensors: Sequence[torch.Tensor], sizes: dict[str, int] | None = None
) -> list:
    """Run ``compiled`` (a program of host memory) on CPU ``tensors`` read as numpy views, with ``sizes``
    no argument carries; every result as a tensor that aliases no input and no other result."""
    arrays = numpy_views(torch, tensors, True)
    return wrap(torch, owned(compiled.run(arrays, sizes), arrays), True)


# device memory: in place, on the current stream ------------------------------------------------
#: the numpy types of device memory torch has tensors of, by name (uint16, bf16 patterns, goes as int16)
TORCH_MEMORY = {"float32", "float16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool"}


class DeviceMemory:
    """A call's device memory from PyTorch's caching allocator (``Program.on_stream``'s ``allocate``):
    its results and workspace are tensors on the call's device, allocated on its current stream, as a
    torch op's are.  No allocation or free of the call reaches the driver (a driver's free waits for
    the device), and torch's memory statistics and limits see it.  A result made in such memory
    comes back as its tensor (:meth:`tensor`); the tensors are held weakly, so workspace is given
    back as soon as the program lets it go."""

    def __init__(self, torch: Any, device: Any):
        self.torch, self.device = torch, device
        self.given: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()

    def __call__(self, shape: tuple[int, ...], dtype: np.dtype) -> torch.Tensor | None:
        kind = "int16" if np.dtype(dtype) == np.uint16 else np.dtype(dtype).name
        if kind not in TORCH_MEMORY:
            return None  # a type torch has no tensors of: the program allocates it
        tensor = self.torch.empty(shape, dtype=getattr(self.torch, kind), device=self.device)
        self.given[tensor.data_ptr()] = tensor
        return tensor

    def tensor(self, result: Any) -> torch.Tensor | None:
        """``result`` (device memory with the CUDA array interface) as the tensor it was allocated as,
        reshaped to it; None for memory that is no tensor's whole (an input's view, say)."""
        interface = result.__cuda_array_interface__
        tensor = self.given.get(interface["data"][0])
        shape = tuple(interface["shape"])
        dense = interface.get("strides") is None  # C-contiguous (the array interface's convention)
        if tensor is None or not dense or math.prod(shape) != tensor.numel():
            return None
        return tensor.view(shape)


def run_in_place(
    torch: Any, compiled: Compilation, tensors: Sequence[torch.Tensor], sizes: dict[str, int] | None = None
) -> list[torch.Tensor]:
    """Run ``compiled`` on device ``tensors`` used in place (``Program.device_type``: CUDA memory through
    ``__cuda_array_interface__``), with ``sizes`` no argument carries (a chunk's offsets); every result.

    Every launch, allocation and copy of the call is enqueued on PyTorch's current stream
    (``Program.on_stream``), so the call orders with the tensors' producers and consumers as any
    torch op does, with no synchronisation, and its device memory comes from PyTorch's caching
    allocator (:class:`DeviceMemory`).  bf16 the kernels read in 16 bits (``Program.bf16_bits``)
    goes as its bit patterns (``Program.bf16_patterns``), other bf16 as float32; results are tensors
    on the inputs' device, aliasing no input and no other result.
    """
    program = compiled.program
    device = next((t.device for t in tensors if not is_host_scalar(t)), tensors[0].device)
    # detach: __cuda_array_interface__ refuses tensors that require grad; a CPU scalar goes by value
    inputs = [t.detach().contiguous() if t.requires_grad or not t.is_contiguous() else t for t in tensors]
    bits = program.bf16_bits
    args = [
        (program.bf16_patterns(t.view(torch.int16)) if k in bits else t.float()) if t.dtype == torch.bfloat16 else t
        for k, t in enumerate(inputs)
    ]
    args = [a.numpy() if is_host_scalar(a) else a for a in args]  # a CPU scalar by value (bf16: as float32)
    memory = DeviceMemory(torch, device)
    with program.on_stream(torch.cuda.current_stream(device).cuda_stream, memory):
        outputs = compiled.run(args, sizes)
    results: list[torch.Tensor] = []
    taken = {t.untyped_storage().data_ptr() for t in inputs if not is_host_scalar(t)}
    for out, value in zip(outputs, compiled.func.results):
        if isinstance(out, np.ndarray):  # 0-d results stay on the host
            result = from_numpy(torch, np.array(out)).to(device)
        elif (patterns := program.bf16_patterns_of(out)) is not None:  # written as bf16 patterns by the kernel
            result = memory.tensor(patterns)
            if result is None:
                result = torch.as_tensor(patterns.view(np.int16), device=device)
            result = result.view(torch.int16).view(torch.bfloat16)
        else:
            result = memory.tensor(out)
            if result is None:
                result = torch.as_tensor(out, device=device)
        if value.type.dtype == "bf16":  # rounded to the declared type, on the device
            result = result.to(torch.bfloat16)
        if result.untyped_storage().data_ptr() in taken:  # as owned() does on the host: outputs alias nothing
            result = result.clone()
        taken.add(result.untyped_storage().data_ptr())
        results.append(result)
    return results


def is_host_scalar(tensor: Any) -> bool:
    """Whether ``tensor`` is a 0-d CPU tensor: a device call takes it by value (as PyTorch's ops take
    CPU scalars beside CUDA tensors), with no copy to or from the device."""
    return tensor.dim() == 0 and tensor.device.type == "cpu"


def run_tensors(
    torch: Any, compiled: Compilation, tensors: Sequence[torch.Tensor], sizes: dict[str, int] | None = None
) -> list[torch.Tensor]:
    """``compiled``'s results on ``tensors`` (where its program reads them: checked by the caller), with
    ``sizes`` no argument carries: CPU tensors as numpy views, device tensors in place."""
    if compiled.program.device_type == "cpu":
        return run_on_host(torch, compiled, tensors, sizes)
    return run_in_place(torch, compiled, tensors, sizes)
