"""The built CUDA function (:class:`CudaFunction`) and what it lists of its kernels (:class:`KernelInfo`).

``build`` (``numba_cuda/__init__.py``) makes one from the generated driver and its kernels; the
host helpers it calls (``host/``) are imported on use, so that this module loads without numba-cuda.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from attncomp.backends.base import Program
from attncomp.backends.numba_cuda.choice import KernelChoice
from attncomp.ir.core import Func
from attncomp.ir.types import CACHE_DTYPES, NUMPY_DTYPES


@dataclass(frozen=True)
class KernelInfo:
    """One generated kernel: its Python function, the Numba signature its PTX is made for (what a call
    with C-contiguous arrays dispatches), its source, the launch bounds it is compiled with, and for
    an attention or backward kernel which kernel it is (``choice.KernelChoice``: family, scalar FMA
    or tensor-core atom, storage, accumulation, deterministic or atomic; None for the graph kernels)."""

    name: str
    py_func: Any
    signature: str
    source: str
    launch_bounds: Any = None
    choice: KernelChoice | None = None


class CudaFunction(Program):
    """The built function (``base.Program``): the driver module's ``run`` gives the outputs.

    Numpy arguments are copied to the device and the results back; when any
    argument is device memory, the results stay on the device.  bf16 arguments in
    ``bf16_bits`` go over as their 16-bit patterns, other bf16 widened (``widen-bf16``).
    """

    backend = "cuda"

    def __init__(
        self,
        driver_source: str,
        module: ModuleType,
        graph_kernels: list[Any],
        attention: list[Any],
        backward: list[Any] | None = None,
    ):
        self.driver_source = driver_source
        self.module = module
        self.graph_kernels = graph_kernels
        self.attention = attention
        #: the backward kernels (``BackwardKernels``), one per ``ac.key_grid``
        self.backward = backward or []
        #: the function the kernels were generated from (bf16 values widened: ``widen-bf16``)
        self.func: Func | None = None
        #: per result: whether the spec declares it bf16 (rounded to it on the way back to the host)
        self.bf16_results: list[bool] = []
        #: per function called: the sizes bound for each key of device arguments (``bind_device_arguments``)
        self._bound: dict[int, dict[tuple, dict[str, int]]] = {}

    def run_bound(self, arrays: Sequence[Any], env: dict[str, int]) -> list[Any]:
        return list(self.module.run(*arrays, env, self.attention, self.backward))

    def run(
        self, func: Func, args: Sequence[Any], constraints: Sequence[Any] = (), sizes: dict[str, int] | None = None
    ) -> list[Any]:
        """Bind the call's arguments (device arrays are checked, not copied) and run: every result,
        numpy arrays of the declared types, or device arrays when an argument was one.

        bf16 values compute as float32 (``widen-bf16``): arguments bind to the widened signature; a
        bf16 argument in ``bf16_bits`` goes over as its patterns (:meth:`stored`), another is
        widened (host arrays before they are copied in, ``Bf16Bits`` by a kernel).  Results
        declared bf16 come back as bf16 on the host and as ``Bf16Bits`` on the device: attention
        outputs the kernels write as bf16 patterns (``bf16_outputs``) as they are, others rounded
        to nearest even by a kernel."""
        from attncomp.backends.numba_cuda.host import arrays
        from attncomp.backends.numba_cuda.host.arguments import bind_device_arguments, tensor_patterns

        args = tensor_patterns(args, [a.name or f"arg{k}" for k, a in enumerate(func.args)])
        bound_func = self.func or func
        seen = self._bound.setdefault(id(bound_func), {})  # a function's constraints are its own
        bound, env = bind_device_arguments(bound_func, args, constraints, sizes, seen)
        # bf16 patterns go on as given: stored() checks that the kernels read that argument so
        given = [x if isinstance(x, arrays.Bf16Bits) else a for x, a in zip(args, bound)]
        bound = [self.stored(k, a, func.args[k].name or f"arg{k}") for k, a in enumerate(given)]
        outputs = self.run_bound(bound, env)
        bf16 = np.dtype(NUMPY_DTYPES["bf16"])
        results = []
        for o, narrow in zip(outputs, self.bf16_results or [False] * len(outputs)):
            if narrow and getattr(getattr(o, "dtype", None), "itemsize", 0) == 2:  # bf16 patterns, returned
                o = o.view(bf16) if isinstance(o, np.ndarray) else arrays.Bf16Bits(o)
            elif narrow and isinstance(o, np.ndarray):
                o = o.astype(bf16)
            elif narrow:  # computed in float32 on the device: rounded there, as its patterns
                o = arrays.rounded(o)
            results.append(o)
        return results

    def stored(self, k: int, array: Any, name: str) -> Any:
        """Argument ``k`` as the device holds it: bf16 as 16-bit patterns where the kernels read them
        so (``bf16_bits``: host arrays viewed, device memory given as ``arrays.Bf16Bits``), else
        widened to float32 (host arrays on the host, ``Bf16Bits`` by a kernel on the device)."""
        from attncomp.backends.numba_cuda.host import arrays

        bf16 = np.dtype(NUMPY_DTYPES["bf16"])
        if k in self.bf16_bits:
            if isinstance(array, arrays.Bf16Bits) or arrays.is_device(array) and array.dtype.itemsize == 2:
                return arrays.device_view(array)
            if isinstance(array, np.ndarray) and array.dtype == bf16:
                return array.view(np.uint16)
            got = array.dtype.name if hasattr(array, "dtype") else type(array).__name__
            raise TypeError(f"{name}: expected bf16 (bfloat16) elements, got {got}")
        if isinstance(array, np.ndarray) and array.dtype == bf16:
            return array.astype(np.float32)
        if isinstance(array, arrays.Bf16Bits):  # patterns where the kernels read float32: widened, not reinterpreted
            return arrays.widen(array, name)
        return array

    # decoders keep their cache on the device --------------------------------------------
    #: a decoder over this backend allocates its cache with :meth:`zeros` and reads shapes with :meth:`shape_view`
    cache_on_device = True

    def page_storage(self) -> Any:
        """A paged decoder's pool in device memory (pages written and copied by kernels), for this
        function's pages (the arguments its ``ac.page_view`` ops read): bf16 pages as 16-bit patterns
        where its kernels read them so (``bf16_bits``), else float32.  The pool takes its storage from
        the function that reads it, so the two cannot disagree."""
        from attncomp.backends.numba_cuda.host.pages import DevicePages

        func = self.func
        views = [op for op in func.body.ops if op.name == "ac.page_view"] if func is not None else []
        pages = {func.args.index(op.operands[0]) for op in views if op.operands[0] in func.args}
        return DevicePages(bits=bool(pages) and pages <= self.bf16_bits)

    def zeros(self, shape: tuple[int, ...], dtype: Any, arg: int | None = None) -> Any:
        """A zeroed device array (a decoder's cache: steps append to it in place, never copying it);
        for argument ``arg`` kept as bf16 patterns (``bf16_bits``), their 16 bits (``Bf16Bits``); for an
        8-bit cache, its codes as bytes (``CacheCodes``)."""
        from attncomp.backends.numba_cuda.host import arrays

        if arg in self.bf16_bits:
            array = arrays.scratch(shape, np.dtype(np.uint16))
            arrays.fill_zero(array)
            return arrays.Bf16Bits(array)
        if np.dtype(dtype).name in {np.dtype(NUMPY_DTYPES[t]).name for t in CACHE_DTYPES}:
            codes = arrays.scratch(shape, np.dtype(np.uint8))  # an 8-bit cache: its codes as bytes
            arrays.fill_zero(codes)
            return arrays.CacheCodes(codes, dtype)
        array = arrays.scratch(shape, arrays.device_dtype(dtype))
        arrays.fill_zero(array)
        return array

    def on_device(self, x: Any) -> bool:
        from attncomp.backends.numba_cuda.host import arrays

        return arrays.is_device(x)

    # memory PyTorch (or another library) hands over --------------------------------------
    #: CUDA memory is read in place, through ``__cuda_array_interface__``
    device_type = "cuda"

    def on_stream(
        self, handle: int, allocate: Callable[[tuple[int, ...], np.dtype], Any] | None = None
    ) -> contextlib.AbstractContextManager[Any]:
        """Every launch, allocation and copy of a call inside on the CUDA stream ``handle`` (wrapped as a
        Numba external stream: ``host.launches.on_stream``), its device memory from ``allocate`` where
        given (``host.arrays.allocate``)."""
        from numba import cuda

        from attncomp.backends.numba_cuda.host.launches import on_stream

        return on_stream(cuda.external_stream(handle), allocate)

    def bf16_patterns(self, bits: Any) -> Any:
        """16-bit device memory as bf16 patterns (``host.arrays.Bf16Bits``): kept in 16 bits for the
        arguments in ``bf16_bits``, widened by a kernel for the others."""
        from attncomp.backends.numba_cuda.host import arrays

        return arrays.Bf16Bits(bits)

    def bf16_patterns_of(self, result: Any) -> Any | None:
        """A bf16 result's patterns: the 16-bit device array of a ``Bf16Bits``, the uint16 view of a
        host one (0-d results come back to the host)."""
        from attncomp.backends.numba_cuda.host import arrays

        if isinstance(result, arrays.Bf16Bits):
            return result.bits
        return super().bf16_patterns_of(result)

    def sliced(self, x: Any, index: tuple[slice, ...]) -> Any:
        """A device array's view without Numba's walk over its contiguous runs (``arrays.sliced``)."""
        from attncomp.backends.numba_cuda.host import arrays

        return arrays.sliced(x, index)

    def shape_view(self, x: Any, name: str) -> Any:
        """What the shared shape checks read: a stand-in for a device array (no copy) of the element type
        it stands for (bf16 for bf16 patterns, a torch CUDA bf16 tensor's too), else numpy."""
        from attncomp.backends.numba_cuda.host import arrays
        from attncomp.backends.numba_cuda.host.arguments import declared, stand_in, tensor_patterns
        from attncomp.ir.binding import as_array

        (x,) = tensor_patterns([x], [name])
        return stand_in(arrays.device_view(x), declared(x)) if arrays.is_device(x) else as_array(x, name)

    def outputs_for(self, outputs: Sequence[Any], inputs: Sequence[Any]) -> list[Any]:
        """Results on the host when every input was, else where the kernels left them."""
        from attncomp.backends.numba_cuda.host import arrays

        if any(arrays.is_device(x) for x in inputs):
            return list(outputs)
        return [
            o.copy_to_host()
            if isinstance(o, arrays.Bf16Bits)  # bf16 patterns: ml_dtypes.bfloat16 on the host
            else arrays.copy_to_host(arrays.device_view(o))
            if arrays.is_device(o)
            else o
            for o in outputs
        ]

    def _head_dims(self, kernels: Any, head_dim: int | None, value_dim: int | None) -> tuple[int, int]:
        done = kernels.specialised
        if head_dim is None and done:
            return done[-1]
        head_dim = 64 if head_dim is None else head_dim
        return head_dim, head_dim if value_dim is None else value_dim

    @property
    def source(self) -> str:
        """The driver module, then each attention and backward kernel as specialised so far (D = E = 64
        before any call)."""
        chunks = [self.driver_source]
        for kernels in [*self.attention, *self.backward]:
            for dims in kernels.specialised or [(64, 64)]:
                chunks.append(kernels.source(*dims))
        return "\n\n".join(chunks)

    def kernels(self, head_dim: int | None = None, value_dim: int | None = None) -> list[KernelInfo]:
        """Every kernel; attention kernels for these head dims (default: the last ones called, else 64),
        each with its ``choice`` (``KernelInfo.choice``)."""
        found = []
        for kernel in self.graph_kernels:
            dispatcher = getattr(self.module, kernel.name)
            info = KernelInfo(kernel.name, dispatcher.py_func, kernel.signature, kernel.source, bounds(dispatcher))
            found.append(info)
        for kernels in [*self.attention, *self.backward]:
            dims = self._head_dims(kernels, head_dim, value_dim)
            # arguments read through transposed views (FlashAttention's layout): rows a pitch apart
            pitched = {"pitched": True} if kernels.views else {}
            info = group_kernel(kernels, f"{kernels.name}[D={dims[0]},E={dims[1]}]", *dims, **pitched)
            found.append(info)
            for suffix, kernel, signature, extra in kernels.extra_kernels(*dims, **pitched):
                name = f"{kernels.name}{suffix}[D={dims[0]},E={dims[1]}]"
                found.append(KernelInfo(name, kernel.py_func, signature, info.source, bounds(kernel), extra))
        return found

    def decode_kernels(
        self, head_dim: int = 64, value_dim: int | None = None, rows: int = 1, group: int = 1
    ) -> list[KernelInfo]:
        """The attention kernels as a call with ``rows`` query rows (a decoding step) runs them, with
        ``group`` query heads a key/value head (GQA: their rows packed into tensor-core tiles where
        the grid allows, ``AttentionKernels.packed_rows``)."""
        value_dim = head_dim if value_dim is None else value_dim
        found = []
        for kernels in self.attention:
            packed = kernels.packed_rows(rows, group, head_dim, value_dim)  # rows a block, where packed
            name = f"{kernels.name}[D={head_dim},E={value_dim},rows={rows}" + (f",group={group}]" if packed else "]")
            block = rows if packed is None else packed
            found.append(group_kernel(kernels, name, head_dim, value_dim, block, packed=packed is not None))
        return found

    def ptx_for(
        self, cc: tuple[int, int] | None = None, head_dim: int | None = None, value_dim: int | None = None
    ) -> dict[str, str]:
        """PTX text of every kernel for compute capability ``cc`` (default: this GPU's, else 8.0)."""
        from attncomp.backends.numba_cuda.ptx import DEFAULT_CC, compile_ptx

        if cc is None:
            cc = DEFAULT_CC
            try:
                from numba import cuda

                if cuda.is_available():
                    cc = cuda.get_current_device().compute_capability
            except Exception:  # no driver: PTX for the default target
                pass
        kernels = self.kernels(head_dim, value_dim)
        return {k.name: compile_ptx(k.py_func, k.signature, cc, k.launch_bounds) for k in kernels}

    @property
    def ptx(self) -> dict[str, str]:
        """PTX of every kernel, by kernel name (see :meth:`ptx_for`)."""
        return self.ptx_for()

    def inspect_asm(self) -> str:
        """The PTX of every kernel, one after another (what ``fn.inspect_asm()`` shows)."""
        return "\n".join(f"// ----- {name} -----\n{text}" for name, text in self.ptx.items())


def bounds(dispatcher: Any) -> Any:
    """The launch bounds a kernel's ``cuda.jit`` was given (None: none, or under the simulator)."""
    return getattr(dispatcher, "targetoptions", {}).get("launch_bounds")


def group_kernel(kernels: Any, name: str, *args: Any, **options: Any) -> KernelInfo:
    """The kernel of an attention or backward group (``AttentionKernels``, ``BackwardKernels``) for
    ``args`` (head dims, then rows and the like) and ``options`` (``splits=False``: the one-split
    forward), named ``name``."""
    dispatcher = kernels.kernel(*args, **options)
    source, choice = kernels.source(*args, **options), kernels.choice_for(*args, **options)
    return KernelInfo(name, dispatcher.py_func, kernels.signature(), source, bounds(dispatcher), choice)
