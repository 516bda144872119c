"""The Numba-CUDA backend: the final IR as ``numba.cuda.jit`` kernels and a host driver.

Each tiled attention becomes a fused flash-attention kernel: the scalar FMA kernels of ``simt/``
(``simt/forward_kernel.py``: one thread block per batch position and query block, key/value chunks
in shared memory, the online-softmax state in registers, tiles skipped, masked or unmasked as
mask-elimination decided), or the tensor-core kernels of ``mma/``.  Each tiled backward
(``ac.key_grid``) a kernel with one thread block per batch position and key block that adds its
gradients in with atomics (``simt/backward_kernel.py``, ``mma/backward_kernel.py``; a grid marked
``deterministic = true`` runs kernels without floating-point atomics instead,
``mma/deterministic.py`` or ``simt/deterministic_backward.py``); which kernel runs is
``choice.py``'s.  Every other op becomes
a small generated kernel (``host/graph_kernels.py``) launched by the generated driver
(``host/driver.py``); :func:`build` makes the function (``program.py``).  Needs the ``cuda`` extra
(numba-cuda); runs on a GPU or under Numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``, set before
Numba is imported), and compiles to PTX with neither.
"""

from __future__ import annotations

from attncomp.backends.numba_cuda.choice import bf16_outputs, tensor_core_types
from attncomp.backends.numba_cuda.program import CudaFunction
from attncomp.errors import AttncompError
from attncomp.ir.copying import copy_module
from attncomp.ir.core import Module
from attncomp.ir.retype import holds_dtype, retype


class CudaUnavailable(AttncompError):
    """numba-cuda is not installed."""


def _require_numba_cuda() -> None:
    import importlib.util

    if importlib.util.find_spec("numba_cuda") is None:
        raise CudaUnavailable("the cuda backend needs numba-cuda: pip install 'attncomp[cuda]'")


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
    from attncomp.backends import front_end
    from attncomp.backends.cache import load_source
    from attncomp.backends.numba_cuda import lowering_fix
    from attncomp.backends.numba_cuda.attention import AttentionKernels
    from attncomp.backends.numba_cuda.backward import BackwardKernels
    from attncomp.backends.numba_cuda.host.driver import generate_driver

    lowering_fix.install()  # before any kernel of the program is compiled
    front_end.install("cuda")

    declared = [r.type.dtype for r in module.main.results]
    choices, bits, backward_chosen = tensor_core_types(module, lanes is not None, backward_lanes is not None)
    narrow = bf16_outputs(module)
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
    kept = frozenset(func.args[k] for k in bits)
    source, graph_kernels = generate_driver(func, attention, backward, kept, tuple(d == "bf16" for d in declared))
    module_ = load_source(source, "cuda")
    program = CudaFunction(source, module_, graph_kernels, list(attention.values()), list(backward.values()))
    program.bf16_results = [d == "bf16" for d in declared]
    program.bf16_bits = bits
    program.func = func
    return program
