"""What every backend provides: the ``Program`` a build returns.

A backend turns a final IR module into a :class:`Program` (``build``).  The
compiled function and every feature built on it (gradients, the decoder,
the paged decoder, chunked runs, the torch op) use this interface only:

- ``run`` checks and binds a call's arguments, runs, and gives every result
  (numpy arrays of the declared types, or device arrays when an argument
  was one); ``run_bound`` runs arrays already bound, with their sizes.
- ``source`` is what runs (generated source, or the final IR); ``ptx``,
  ``inspect_llvm`` and ``inspect_asm`` where the backend has them.
- Storage: where a decoder's cache and a paged pool live (``zeros``,
  ``shape_view``, ``outputs_for``, ``page_storage``), host memory unless
  the backend keeps them on a device.
- Memory another library hands over (the torch op, ``attncomp/torch/``): which device's
  memory the kernels read in place (``device_type``), the stream a call is enqueued on
  (``on_stream``), and bf16 memory as its 16-bit patterns (``bf16_patterns``,
  ``bf16_patterns_of``).

``Program`` implements the host-storage defaults; a backend overrides what
differs.  A new backend is a package with ``build(module) -> Program``
named in ``attncomp.backends.BUILDERS``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from attncomp.backends.host_pages import HostPages
from attncomp.ir.binding import as_array, bind_arguments
from attncomp.ir.core import Func
from attncomp.ir.types import NUMPY_DTYPES

#: numpy's bfloat16 (ml_dtypes')
BF16 = np.dtype(NUMPY_DTYPES["bf16"])


class Program:
    """A built function: the interface between a backend and everything that calls it."""

    #: the backend's name ("interp", "cpu", "cuda")
    backend: str = ""
    #: generated source (or the final IR) of what runs
    source: str = ""
    #: whether the results are the float64 reference (the interpreter)
    reference: bool = False
    #: whether a decoder's cache and a pool's pages live in device memory
    cache_on_device: bool = False
    #: whether a run writes a decoder's new keys and values into its cache arguments itself (an
    #: 8-bit cache's codes and scales included); else the decoder stores the returned entries
    appends_in_place: bool = False
    #: whether ``run_bound`` takes host arrays as a caller built them to the signature and gives
    #: results of the declared types (then callers that build their arguments may skip the checks)
    runs_host_arrays: bool = False
    #: argument positions whose bf16 values the device keeps in 16 bits: a caller with bf16 device
    #: memory for one passes its 16-bit patterns (``numba_cuda.host.arrays.Bf16Bits``), not a widened copy
    bf16_bits: frozenset[int] = frozenset()
    #: the device whose memory the kernels read in place, as PyTorch and DLPack name device types:
    #: "cpu" for host memory (numpy arrays; CPU tensors through numpy views), else the device's
    #: (its arrays given through ``__cuda_array_interface__`` for "cuda")
    device_type: str = "cpu"

    # running ---------------------------------------------------------------------------
    def run_bound(self, arrays: Sequence[Any], env: dict[str, int]) -> list[Any]:
        """Run on arrays bound to the signature (``env``: every size); the raw results."""
        raise NotImplementedError

    def run(
        self, func: Func, args: Sequence[Any], constraints: Sequence[Any] = (), sizes: dict[str, int] | None = None
    ) -> list[Any]:
        """Check and bind ``args`` against ``func``'s signature (``sizes``: ones the caller knows), run,
        and give every result as an array of its declared element type."""
        arrays, env = bind_arguments(func, args, constraints, sizes)
        outputs = self.run_bound(arrays, env)
        return [np.asarray(out, dtype=NUMPY_DTYPES[value.type.dtype]) for out, value in zip(outputs, func.results)]

    def call(
        self, func: Func, args: Sequence[Any], constraints: Sequence[Any] = (), sizes: dict[str, int] | None = None
    ) -> Any:
        """:meth:`run`, giving one result or a tuple, as a compiled function does."""
        outputs = self.run(func, args, constraints, sizes)
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    @property
    def compiled(self) -> bool:
        """Whether this process already compiled (or loaded) what a first call runs."""
        return False

    # storage ---------------------------------------------------------------------------
    def zeros(self, shape: tuple[int, ...], dtype: Any, arg: int | None = None) -> Any:
        """A zeroed array where this backend's kernels read it (a decoder's cache, for argument
        ``arg`` of the step's function)."""
        return np.zeros(shape, dtype=dtype)

    def shape_view(self, x: Any, name: str) -> Any:
        """What the shared shape checks read for argument ``x``, without copying it."""
        return as_array(x, name)

    def sliced(self, x: Any, index: tuple[slice, ...]) -> Any:
        """The view ``x[index]`` (slices only) of an array this backend keeps: a decoder's cache up to
        its length."""
        return x[index]

    def on_device(self, x: Any) -> bool:
        """Whether ``x`` is device memory this backend's kernels read where it is (never copied to
        the host on the way in)."""
        return False

    def outputs_for(self, outputs: Sequence[Any], inputs: Sequence[Any]) -> list[Any]:
        """Results where the caller wants them: on the host when every input was."""
        return list(outputs)

    def page_storage(self) -> Any:
        """Where a paged decoder's pool keeps its pages (host memory, or a device's)."""
        return HostPages()

    # memory another library hands over ---------------------------------------------------
    def on_stream(
        self, handle: int, allocate: Callable[[tuple[int, ...], np.dtype], Any] | None = None
    ) -> contextlib.AbstractContextManager[Any]:
        """A context in which every launch, allocation and copy of a call is enqueued on the device
        stream whose raw handle is ``handle`` (another library's, such as PyTorch's current stream),
        so the call orders with that library's work without synchronising.  ``allocate(shape,
        dtype)``, if given, is where the call's device memory comes from (that library's allocator:
        an uninitialised C-contiguous array with the CUDA array interface, of ``dtype`` or an
        integer type of its width; or None, to leave that one to the program).  Host programs run
        in the caller's thread, in order, in their own memory: nothing to do."""
        return contextlib.nullcontext()

    def bf16_patterns(self, bits: Any) -> Any:
        """bf16 memory given as its 16-bit patterns (``bits``: a 16-bit integer array where the kernels
        read it), as :meth:`run` takes an argument in ``bf16_bits``: on the host, the bf16 array
        viewing the same memory."""
        return np.asarray(bits).view(BF16)

    def bf16_patterns_of(self, result: Any) -> Any | None:
        """The 16-bit patterns (an integer array of the same memory) of a bf16 result :meth:`run` gave,
        None for a result of any other type."""
        if isinstance(result, np.ndarray) and result.dtype == BF16:
            return result.view(np.uint16)
        return None

    # inspection ------------------------------------------------------------------------
    @property
    def ptx(self) -> dict[str, str]:
        raise ValueError(f"ptx needs the cuda backend, not {self.backend!r}")

    def inspect_llvm(self) -> str:
        raise ValueError(f"inspect_llvm needs a compiled backend, not {self.backend!r}")

    def inspect_asm(self) -> str:
        raise ValueError(f"inspect_asm needs a compiled backend, not {self.backend!r}")
