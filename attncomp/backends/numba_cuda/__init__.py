"""The Numba-CUDA backend: the final IR as ``numba.cuda.jit`` kernels and a host driver.

Each tiled attention becomes a fused flash-attention kernel (``kernel.py``:
one thread block per batch position and query block, key/value chunks in
shared memory, the online-softmax state in registers, tiles skipped,
masked or unmasked as mask-elimination decided); each tiled backward
(``ac.key_grid``) a kernel with one thread block per batch position and key
block that adds its gradients in with atomics (``backward_kernel.py``; a grid marked
``deterministic = true`` runs kernels without floating-point atomics instead,
``deterministic_backward.py``); every other op becomes a
small generated kernel (``graph_kernels.py``) launched by the generated
driver (``driver.py``).  Needs the ``cuda`` extra (numba-cuda); runs on a
GPU or under Numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``, set before
Numba is imported), and compiles to PTX with neither.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from attncomp.backends.base import Program
from attncomp.backends.numba_cuda.choice import KernelChoice, choose
from attncomp.errors import AttncompError
from attncomp.ir.copying import copy_module
from attncomp.ir.core import Func, Module, Op
from attncomp.ir.retype import holds_dtype, retype
from attncomp.ir.types import NUMPY_DTYPES


class CudaUnavailable(AttncompError):
    """numba-cuda is not installed."""


def _require_numba_cuda() -> None:
    import importlib.util

    if importlib.util.find_spec("numba_cuda") is None:
        raise CudaUnavailable("the cuda backend needs numba-cuda: pip install 'attncomp[cuda]'")


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
        from attncomp.backends.numba_cuda import runtime
        from attncomp.backends.numba_cuda.arguments import bind_device_arguments

        arrays, env = bind_device_arguments(self.func or func, args, constraints, sizes)
        # bf16 patterns go on as given: stored() checks that the kernels read that argument so
        given = [x if isinstance(x, runtime.Bf16Bits) else a for x, a in zip(args, arrays)]
        arrays = [self.stored(k, a, func.args[k].name or f"arg{k}") for k, a in enumerate(given)]
        outputs = self.run_bound(arrays, env)
        bf16 = np.dtype(NUMPY_DTYPES["bf16"])
        results = []
        for o, narrow in zip(outputs, self.bf16_results or [False] * len(outputs)):
            if narrow and getattr(getattr(o, "dtype", None), "itemsize", 0) == 2:  # bf16 patterns, returned
                o = o.view(bf16) if isinstance(o, np.ndarray) else runtime.Bf16Bits(o)
            elif narrow and isinstance(o, np.ndarray):
                o = o.astype(bf16)
            elif narrow:  # computed in float32 on the device: rounded there, as its patterns
                o = runtime.rounded(o)
            results.append(o)
        return results

    def stored(self, k: int, array: Any, name: str) -> Any:
        """Argument ``k`` as the device holds it: bf16 as 16-bit patterns where the kernels read them
        so (``bf16_bits``: host arrays viewed, device memory given as ``runtime.Bf16Bits``), else
        widened to float32 (host arrays on the host, ``Bf16Bits`` by a kernel on the device)."""
        from attncomp.backends.numba_cuda import runtime

        bf16 = np.dtype(NUMPY_DTYPES["bf16"])
        if k in self.bf16_bits:
            if isinstance(array, runtime.Bf16Bits) or runtime.is_device(array) and array.dtype.itemsize == 2:
                return runtime.device_view(array)
            if isinstance(array, np.ndarray) and array.dtype == bf16:
                return array.view(np.uint16)
            got = array.dtype.name if hasattr(array, "dtype") else type(array).__name__
            raise TypeError(f"{name}: expected bf16 (bfloat16) elements, got {got}")
        if isinstance(array, np.ndarray) and array.dtype == bf16:
            return array.astype(np.float32)
        if isinstance(array, runtime.Bf16Bits):  # patterns where the kernels read float32: widened, not reinterpreted
            return runtime.widen(array, name)
        return array

    # decoders keep their cache on the device --------------------------------------------
    #: a decoder over this backend allocates its cache with :meth:`zeros` and reads shapes with :meth:`shape_view`
    cache_on_device = True

    def page_storage(self) -> Any:
        """A paged decoder's pool in device memory (pages written and copied by kernels), for this
        function's pages (the arguments its ``ac.page_view`` ops read): bf16 pages as 16-bit patterns
        where its kernels read them so (``bf16_bits``), else float32.  The pool takes its storage from
        the function that reads it, so the two cannot disagree."""
        from attncomp.backends.numba_cuda.pages import DevicePages

        func = self.func
        views = [op for op in func.body.ops if op.name == "ac.page_view"] if func is not None else []
        pages = {func.args.index(op.operands[0]) for op in views if op.operands[0] in func.args}
        return DevicePages(bits=bool(pages) and pages <= self.bf16_bits)

    def zeros(self, shape: tuple[int, ...], dtype: Any, arg: int | None = None) -> Any:
        """A zeroed device array (a decoder's cache: steps append to it in place, never copying it);
        for argument ``arg`` kept as bf16 patterns (``bf16_bits``), their 16 bits (``Bf16Bits``)."""
        from attncomp.backends.numba_cuda import runtime

        if arg in self.bf16_bits:
            array = runtime.scratch(shape, np.dtype(np.uint16))
            runtime.fill_zero(array)
            return runtime.Bf16Bits(array)
        array = runtime.scratch(shape, device_dtype(dtype))
        runtime.fill_zero(array)
        return array

    def on_device(self, x: Any) -> bool:
        from attncomp.backends.numba_cuda import runtime

        return runtime.is_device(x)

    def shape_view(self, x: Any, name: str) -> Any:
        """What the shared shape checks read: a stand-in for a device array (no copy), else numpy."""
        from attncomp.backends.numba_cuda import runtime
        from attncomp.backends.numba_cuda.arguments import stand_in
        from attncomp.ir.binding import as_array

        return stand_in(runtime.device_view(x)) if runtime.is_device(x) else as_array(x, name)

    def outputs_for(self, outputs: Sequence[Any], inputs: Sequence[Any]) -> list[Any]:
        """Results on the host when every input was, else where the kernels left them."""
        from attncomp.backends.numba_cuda import runtime

        if any(runtime.is_device(x) for x in inputs):
            return list(outputs)
        return [
            o.copy_to_host()
            if isinstance(o, runtime.Bf16Bits)  # bf16 patterns: ml_dtypes.bfloat16 on the host
            else runtime.copy_to_host(runtime.device_view(o))
            if runtime.is_device(o)
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
            name = f"{kernels.name}[D={dims[0]},E={dims[1]}]"
            source, dispatcher, choice = kernels.source(*dims), kernels.kernel(*dims), kernels.choice_for(*dims)
            info = KernelInfo(name, dispatcher.py_func, kernels.signature(), source, bounds(dispatcher), choice)
            found.append(info)
            for suffix, kernel, signature, extra in kernels.extra_kernels(*dims):
                name = f"{kernels.name}{suffix}[D={dims[0]},E={dims[1]}]"
                found.append(KernelInfo(name, kernel.py_func, signature, source, bounds(kernel), extra))
        return found

    def decode_kernels(self, head_dim: int = 64, value_dim: int | None = None, rows: int = 1) -> list[KernelInfo]:
        """The attention kernels as a call with ``rows`` query rows (a decoding step) runs them."""
        value_dim = head_dim if value_dim is None else value_dim
        found = []
        for kernels in self.attention:
            name = f"{kernels.name}[D={head_dim},E={value_dim},rows={rows}]"
            dispatcher = kernels.kernel(head_dim, value_dim, rows)
            source, choice = kernels.source(head_dim, value_dim, rows), kernels.choice_for(head_dim, value_dim, rows)
            found.append(KernelInfo(name, dispatcher.py_func, kernels.signature(), source, bounds(dispatcher), choice))
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


def device_dtype(dtype: Any) -> np.dtype:
    """The dtype device memory holds for ``dtype``: bf16 as float32 (see ``widen-bf16``)."""
    dtype = np.dtype(dtype)
    return np.dtype(np.float32) if dtype == np.dtype(NUMPY_DTYPES["bf16"]) else dtype


def widened(module: Module) -> Module:
    """``module`` with every bf16 value computed as float32 (``module`` itself when it holds none):
    what the kernels are generated from, the ``widen-bf16`` pass's output.

    ``ac.compile`` runs that pass after the pipeline (a stage of ``fn.dump()``) and hands its output
    to :func:`build`; a module built directly (``build(module)``) is widened here the same way, on a
    copy.  Query, key and value that only tensor-core attention reads stay bf16 on the device, as
    their 16-bit patterns (``tensor_core_types``; the kernels widen each element as they read it).
    Other bf16 crosses the call's boundary: host arguments are widened before they are copied in,
    and results declared bf16 are rounded to it (round to nearest even) when they come back."""
    if not holds_dtype(module, "bf16"):
        return module
    wide = copy_module(module)
    retype(wide, "bf16", "f32")
    return wide


def tensor_core_types(module: Module, fixed_lanes: bool = False) -> tuple[list[KernelChoice], frozenset[int]]:
    """Per ``ac.tile_grid``: the kernel it runs (``choice.choose``: on tensor cores where query, key
    and value are one type, f16, bf16, or float32 unless its ``precision`` is "ieee" or
    ``fixed_lanes``, a layout of the scalar kernels, is asked for), with the storage the kernel reads
    its query, key and value from (``KernelChoice.storage``); and the positions of the bf16
    arguments kept in 16 bits on the device.

    A bf16 argument stays 16-bit (``"bits"``) when tile loads are all that read it (query, key and
    value passed straight to the attention; it may also be returned); when it is a decoder's cache
    and the appended cache is read by tile loads alone (new entries that are an argument so read are
    appended as their patterns, computed ones rounded to bf16 as they are appended): a decoder's
    device cache then holds bf16, half the bytes a step reads; or when it is a paged decoder's pool
    whose pages (``ac.page_view``) tile loads alone read: the pool then holds bf16
    (``CudaFunction.page_storage``).  A grid reading a decoder's cache reads its computed sources (a
    projected query) from 16-bit copies rounded before it (the driver's ``bf16_patterns``), so that
    the cache can stay bf16.  bf16 values anything else computes with are widened to float32
    (``widen-bf16``)."""
    from attncomp.backends.tiles import read_tiled_attention

    func = module.main
    readers: dict = {}
    for op in func.body.walk():
        for value in op.operands:
            readers.setdefault(value, []).append(op)
    grids = [op for op in func.body.ops if op.name == "ac.tile_grid"]
    sources = []
    for op in grids:
        t = read_tiled_attention(op)
        sources.append([load.operands[0] for load in (t.q_load, t.masked.k_load, t.masked.v_load)])
    tile_loads = {id(op) for op in func.body.walk() if op.name == "ac.tile_load"}

    def appended(value) -> Op | None:
        """The ``ac.cache_append`` to a decoder's cache (an argument) that ``value`` is."""
        owner = value.owner
        if getattr(owner, "name", None) == "ac.cache_append" and owner.operands[0] in func.args:
            return owner
        return None

    def paged(value) -> Op | None:
        """The ``ac.page_view`` of an argument (a paged decoder's pool) that ``value`` is."""
        owner = value.owner
        if getattr(owner, "name", None) == "ac.page_view" and owner.operands[0] in func.args:
            return owner
        return None

    def computed(value) -> bool:
        return value not in func.args and appended(value) is None and paged(value) is None

    def origins(value) -> list:
        """The arguments whose memory a tile source is: itself; the cache, and the new entries appended
        to it where they are an argument; or the pool a page view reads (its table is integers)."""
        append, view = appended(value), paged(value)
        if append is not None:
            return [v for v in append.operands if v in func.args]
        if view is not None:
            return [view.operands[0]]
        return [value] if value in func.args else []

    def read_as_patterns(value) -> bool:
        """Every op reading ``value`` can take 16-bit patterns: tile loads, such an append or page view,
        and (for an argument, handed back as it came) the return."""
        allowed = tile_loads | {id(func.body.ops[-1])} if value in func.args else tile_loads
        return all(id(op) in allowed or bool(op.results) and keeps_patterns(op) for op in readers.get(value, []))

    def keeps_patterns(op: Op) -> bool:
        return appended(op.results[0]) is not None or paged(op.results[0]) is not None

    def as_patterns(value, cached: bool) -> bool:
        """Whether a tile source can be read as patterns: its memory read as patterns alone, or (in a
        grid reading a decoder's cache) computed, and rounded into a 16-bit copy."""
        if computed(value):
            return cached
        return read_as_patterns(value) and all(map(read_as_patterns, origins(value)))

    chosen = [choose(op, fixed_lanes=fixed_lanes) for op in grids]
    bits = set()
    for k, values in enumerate(sources):
        cached = any(appended(v) is not None for v in values)
        if chosen[k].operands == "bf16" and all(as_patterns(v, cached) for v in values):
            bits.add(k)
    args_of = [{a for v in values for a in origins(v)} for values in sources]
    while True:  # an argument kept 16-bit is so for every grid that reads it
        shared = {k for k in bits for j in set(range(len(grids))) - bits if args_of[k] & args_of[j]}
        if not shared:
            break
        bits -= shared
    found = [choose(op, "bits", fixed_lanes) if k in bits else chosen[k] for k, op in enumerate(grids)]
    kept = {func.args.index(a) for k in bits for a in args_of[k]}
    return found, frozenset(kept)


def bf16_outputs(module: Module) -> list[bool]:
    """Per ``ac.tile_grid``: whether its kernel writes its output as bf16 patterns (uint16, rounded
    to nearest even in the kernel): the output is declared bf16 and the function returns it, which
    nothing else reads.  Half the bytes a float32 output writes, and no rounding pass after."""
    func = module.main
    ret = func.body.ops[-1]
    readers: dict = {}
    for op in func.body.walk():
        for value in op.operands:
            readers.setdefault(value, []).append(op)
    found = []
    for op in func.body.ops:
        if op.name == "ac.tile_grid":
            out = op.results[0]
            found.append(out.type.dtype == "bf16" and all(r is ret for r in readers.get(out, [])))
    return found


def backward_choices(module: Module, fixed_lanes: bool = False) -> list[KernelChoice]:
    """Per ``ac.key_grid``: the kernel it runs (``choice.choose``): on tensor cores where query, key,
    value and output gradient are one type (f16 or bf16, or float32 as 3xTF32 or tf32 by the grid's
    ``precision``, "exact" or "tf32"), else, for a ``deterministic`` grid or with ``fixed_lanes`` (a
    layout of the scalar kernel), the scalar kernels; the device holds the operands as "f16", or
    "f32": float32, or bf16 widened (``widen-bf16``)."""
    return [choose(op, fixed_lanes=fixed_lanes) for op in module.main.body.ops if op.name == "ac.key_grid"]


def build(
    module: Module,
    lanes: int | None = None,
    split: int | None = None,
    backward_lanes: int | None = None,
    lowered: Module | None = None,
) -> CudaFunction:
    """Generate and load the driver and graph kernels; attention kernels are made per head dims on use.

    ``module`` is the pipeline's final IR, whose declared types the call keeps; the kernels are
    generated from ``lowered``, the ``widen-bf16`` pass's output (default: :func:`widened`; a module
    without bf16 is its own, the same IR).

    ``lanes`` fixes the threads per query row of the attention kernels (the
    default chooses by head dim; tests use it to cover every layout at small
    sizes); ``split`` fixes the number of key splits (flash-decoding; the
    default splits only launches too small to fill the GPU); ``backward_lanes`` fixes the threads per
    key of the backward kernels.
    """
    _require_numba_cuda()
    from attncomp.backends.cache import load_source
    from attncomp.backends.numba_cuda.attention import AttentionKernels
    from attncomp.backends.numba_cuda.backward import BackwardKernels
    from attncomp.backends.numba_cuda.driver import generate_driver

    declared = [r.type.dtype for r in module.main.results]
    choices, bits = tensor_core_types(module, fixed_lanes=lanes is not None)
    narrow = bf16_outputs(module)
    backward_chosen = backward_choices(module, fixed_lanes=backward_lanes is not None)
    if lowered is None or not holds_dtype(module, "bf16"):
        # nothing to widen: the pipeline's module itself, whose value names the sources keep
        lowered = widened(module)
    func = lowered.main
    grids = [op for op in func.body.ops if op.name == "ac.tile_grid"]
    attention = {
        op: AttentionKernels(k, op, func, choices[k], lanes, split, out_bits=narrow[k]) for k, op in enumerate(grids)
    }
    key_grids = [op for op in func.body.ops if op.name == "ac.key_grid"]
    backward = {
        op: BackwardKernels(k, op, func, choice, backward_lanes)
        for k, (op, choice) in enumerate(zip(key_grids, backward_chosen))
    }
    source, graph_kernels = generate_driver(func, attention, backward)
    module_ = load_source(source, "cuda")
    program = CudaFunction(source, module_, graph_kernels, list(attention.values()), list(backward.values()))
    program.bf16_results = [d == "bf16" for d in declared]
    program.bf16_bits = bits
    program.func = func
    return program
