"""Which kernel runs an attention: one value, :class:`KernelChoice`, made by :func:`choose`.

An ``ac.tile_grid`` (the forward) or ``ac.key_grid`` (the backward) runs one of several kernels:
the scalar FMA kernels (``simt/forward_kernel.py``, ``simt/backward_kernel.py``, ``simt/deterministic_backward.py`` with
its dQ pass), or products on tensor cores (``mma/forward_kernel.py``, ``mma/backward_kernel.py``,
with the operands of ``mma/operands.py``) on one of the atoms of
``atoms.ATOMS``.  :func:`choose` decides which from the grid's IR and the call's types (the
element type of query, key, value and output gradient, the grid's ``precision`` and
``deterministic``), once per grid; the plans and writers read the choice's fields.  Where the plan
for a call's head dims (or rows) does not fit the tensor cores, the scalar kernel runs it
(:meth:`KernelChoice.scalar`).  Each generated kernel carries its choice as the first line of its
source (:meth:`KernelChoice.header`), and ``fn.kernels()`` lists it (``KernelInfo.choice``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from attncomp.backends.numba_cuda.mma.atoms import ATOMS, MmaAtom
from attncomp.ir.core import Module, Op
from attncomp.ir.types import CACHE_DTYPES, accumulation_dtype

#: the kernel families: an attention's forward, its backward (dK, dV, and dQ by atomics or in a
#: pass of its own), and the dQ pass of a deterministic backward
FORWARD, BACKWARD, DQ = "forward", "backward", "dq pass"
#: the 16-bit element types tensor cores multiply (with float32 accumulation)
HALF_ELEMENTS = ("f16", "bf16")
#: how the device holds query, key and value, as :meth:`KernelChoice.describe` names it
STORAGE_NAMES = {"f32": "f32", "f16": "f16", "bits": "bf16 bits"}
#: flash-tiling's ``precision`` of float32 tile products -> whether they are exact (3xTF32); absent:
#: not on tensor cores ("ieee")
EXACT_BY_PRECISION = {"exact": True, "tf32": False}


@dataclass(frozen=True)
class KernelChoice:
    """The kernel of one attention grid.

    ``family``: :data:`FORWARD`, :data:`BACKWARD` or :data:`DQ`.  ``atom``: the tensor-core
    instruction of the products (``mma_atoms``), None for the scalar FMA kernels; ``operands`` its
    operand type ("f16", "bf16" or "tf32"), and for "tf32" ``exact``: each float32 operand split into
    two tf32 parts and three products made (3xTF32, ``precision = "exact"``), else one product
    (``precision = "tf32"``).  ``storage``: how the device holds query, key and value ("f32"; "f16";
    "bits": bf16 as its 16-bit patterns); ``accumulate``: the accumulation type; ``deterministic``:
    sums in a fixed order with no floating-point atomics (a backward grid's ``deterministic``)."""

    family: str
    atom: MmaAtom | None = None
    operands: str | None = None
    exact: bool = False
    storage: str = "f32"
    accumulate: str = "f32"
    deterministic: bool = False
    #: keys and values read from a decoder's 8-bit cache ("f8e4m3" or "f8e5m2": codes decoded and
    #: scaled as they are staged, on the scalar kernels); "" for none
    cache: str = ""
    #: keys and values staged by 16-byte asynchronous copies into swizzled shared tiles and read by
    #: ``ldmatrix`` (``mma/flash_kernel.py``): 16-bit operands whose key and value rows are dense
    #: (``arrays.dense_rows``); else staged by loads and stores of 32-bit words
    async_copies: bool = False
    #: the kernel can split its keys over thread blocks (flash-decoding: each block's partial state,
    #: merged by the unit's last block); False: a launch of one split, without that code
    #: (``mma/flash_kernel.py``, chosen per launch where the grid's blocks fill the GPU)
    key_splits: bool = True
    #: a decode step's query heads that share a key/value head packed into the rows of one tile
    #: (``mma/packed_heads.py``): a thread block per (batch position, key/value head)
    packed_heads: bool = False

    @property
    def mma(self) -> bool:
        """Products on tensor cores."""
        return self.atom is not None

    @property
    def tf32(self) -> bool:
        """float32 operands on tf32 products (one, or three of split operands)."""
        return self.operands == "tf32"

    @property
    def products(self) -> str | None:
        """The products' kind as the kernels' comments name it: "f16", "bf16", "tf32", "3xtf32"; None
        for the scalar kernels."""
        return "3xtf32" if self.tf32 and self.exact else self.operands

    def scalar(self) -> KernelChoice:
        """The same grid on the scalar FMA kernels (where its head dims do not fit the tensor cores)."""
        return replace(self, atom=None, operands=None, exact=False, async_copies=False, packed_heads=False)

    def dq(self) -> KernelChoice:
        """A deterministic backward's dQ pass."""
        return replace(self, family=DQ)

    def describe(self) -> str:
        """One line: family, arithmetic, storage, accumulation, deterministic or atomic."""
        arithmetic = f"mma {self.atom.shape} {self.products}" if self.atom is not None else "fma"
        storage = STORAGE_NAMES.get(self.storage, self.storage)
        order = "deterministic" if self.deterministic else "atomic"
        copies = ", async copies" if self.async_copies else ""
        copies += "" if self.key_splits else ", one split"
        copies += ", heads packed" if self.packed_heads else ""
        cache = f", {self.cache} cache" if self.cache else ""
        return f"{self.family}, {arithmetic}{copies}, storage {storage}{cache}, accumulate {self.accumulate}, {order}"

    def header(self) -> str:
        """The comment line a generated kernel's source starts with."""
        return f"# kernel: {self.describe()}"


class OnTensorCores:
    """What a tensor-core plan reads of its ``choice`` (a plan holds one, a ``KernelChoice`` with an
    atom): the instruction, the products' kind and the storage."""

    choice: KernelChoice

    @property
    def atom(self) -> MmaAtom:
        """The instruction of the products (``mma_atoms``)."""
        assert self.choice.atom is not None
        return self.choice.atom

    @property
    def element(self) -> str:
        """The products' kind: "f16", "bf16", "tf32" or "3xtf32" (``KernelChoice.products``)."""
        return str(self.choice.products)

    @property
    def storage(self) -> str:
        return self.choice.storage


def kernel_line(choice: KernelChoice | None) -> list[str]:
    """The line a generated kernel module starts with: its choice (none where none is given)."""
    return [] if choice is None else [choice.header()]


def choose(op: Op, storage: str | None = None, fixed_lanes: bool = False) -> KernelChoice:
    """The kernel ``op`` (an ``ac.tile_grid`` or ``ac.key_grid`` of the pipeline's final IR, before
    ``widen-bf16``) asks for, by the types of its query, key and value (and output gradient).

    Tensor cores where these are one type: f16 or bf16 on ``m16n8k16``; float32 on ``m16n8k8`` in
    tf32, exact (3xTF32) or not by the grid's ``precision`` ("ieee": the scalar kernels).  The
    scalar kernels where the types differ, where ``fixed_lanes`` (a layout of the scalar kernels
    asked for: float32 forwards and every backward), and where keys
    and values are read from a decoder's 8-bit cache or 8-bit pages (``KernelChoice.cache``: the
    tensor-core kernels do not decode codes).  ``storage`` is how the device holds the operands ("bits" where the module
    keeps bf16 arguments 16-bit, ``tensor_core_types``); by default "f16" for f16 and "f32" otherwise."""
    from attncomp.backends.backward_tiles import read_tiled_backward
    from attncomp.backends.numba_cuda.fp8_codes import codes_of
    from attncomp.backends.tiles import read_tiled_attention

    if op.name == "ac.tile_grid":
        family, deterministic = FORWARD, False
        t = read_tiled_attention(op)
        loads = (t.q_load, t.masked.k_load, t.masked.v_load)
    elif op.name == "ac.key_grid":
        family, deterministic = BACKWARD, bool(op.attrs.get("deterministic", False))
        t = read_tiled_backward(op)
        loads = (t.masked.q_load, t.k_load, t.v_load, t.masked.d_out_load)
    else:
        raise ValueError(f"no attention kernel for {op.name}")
    types = {load.operands[0].type.dtype for load in loads}
    element = types.pop() if len(types) == 1 else None
    operands, exact = None, False
    if element in HALF_ELEMENTS:
        operands = element
    elif element == "f32" and not (fixed_lanes and family == FORWARD):
        # float32 on tf32 tensor cores: three products of split operands unless opted into one
        exact = EXACT_BY_PRECISION.get(op.attrs.get("precision", "exact"))
        operands = None if exact is None else "tf32"
        exact = bool(exact)
    if storage is None:
        storage = "f16" if operands == "f16" else "f32"
    choice = KernelChoice(
        family,
        ATOMS[operands] if operands is not None else None,
        operands,
        exact,
        storage,
        accumulation_dtype(op.results[0].type.dtype),
        deterministic,
    )
    quantized = [codes_of(load.operands[0]) for load in loads]
    quantized = [dtype for dtype in quantized if dtype in CACHE_DTYPES]
    if quantized:  # an 8-bit cache or 8-bit pages: the scalar kernels decode the codes as they stage them
        return replace(choice.scalar(), cache=quantized[0])
    if family == BACKWARD and fixed_lanes:
        return choice.scalar()  # lanes are the scalar kernel's
    return choice


def tensor_core_types(
    module: Module, fixed_lanes: bool = False, backward_lanes: bool = False
) -> tuple[list[KernelChoice], frozenset[int], list[KernelChoice]]:
    """Per ``ac.tile_grid``: the kernel it runs (``choice.choose``: on tensor cores where query, key
    and value are one type, f16, bf16, or float32 unless its ``precision`` is "ieee" or
    ``fixed_lanes``, a layout of the scalar kernels, is asked for), with the storage the kernel reads
    its query, key and value from (``KernelChoice.storage``); the positions of the bf16 arguments
    kept in 16 bits on the device; and per ``ac.key_grid`` its kernel the same way (query, key, value
    and output gradient; ``backward_lanes``: the scalar kernel's layout asked for).

    A bf16 argument stays 16-bit (``"bits"``) when tile loads are all that read it (query, key and
    value passed straight to the attention; it may also be returned), besides reductions that take
    their elementwise neighbours inline (``host/fused_reductions.py``: the backward's ``delta =
    rowsum(cast(d_out) cast(out))`` reads ``d_out`` and ``out`` as their patterns); when it is a decoder's cache
    and the appended cache is read by tile loads alone (new entries that are an argument so read are
    appended as their patterns, computed ones rounded to bf16 as they are appended): a decoder's
    device cache then holds bf16, half the bytes a step reads; or when it is a paged decoder's pool
    whose pages (``ac.page_view``) tile loads alone read: the pool then holds bf16
    (``CudaFunction.page_storage``).  A grid reading a decoder's cache reads its computed sources (a
    projected query) from 16-bit copies rounded before it (the driver's ``bf16_patterns``), so that
    the cache can stay bf16.  bf16 values anything else computes with are widened to float32
    (``widen-bf16``)."""
    from attncomp.backends.backward_tiles import read_tiled_backward
    from attncomp.backends.numba_cuda.host.fused_reductions import plan_fused_reductions
    from attncomp.backends.numba_cuda.host.views import transposes_in_place
    from attncomp.backends.tiles import read_tiled_attention

    func = module.main
    views = transposes_in_place(func)
    readers: dict = {}
    for op in func.body.walk():
        for value in op.operands:
            readers.setdefault(value, []).append(op)
    grids = [op for op in func.body.ops if op.name in ("ac.tile_grid", "ac.key_grid")]
    sources = []
    for op in grids:
        if op.name == "ac.tile_grid":
            t = read_tiled_attention(op)
            loads = (t.q_load, t.masked.k_load, t.masked.v_load)
        else:
            b = read_tiled_backward(op)
            loads = (b.masked.q_load, b.k_load, b.v_load, b.masked.d_out_load)
        sources.append([load.operands[0] for load in loads])
    tile_loads = {id(op) for op in func.body.walk() if op.name == "ac.tile_load"}
    fused = {id(o) for f in plan_fused_reductions(func).values() for o in [f.reduce, *f.absorbed]}

    def appended(value) -> Op | None:
        """The ``ac.cache_append`` to a decoder's cache (an argument) that ``value`` is."""
        owner = value.owner
        if getattr(owner, "name", None) == "ac.cache_append" and owner.operands[0] in func.args:
            return owner
        return None

    def paged(value) -> Op | None:
        """The ``ac.page_view`` of an argument (a paged decoder's pool), or the transpose of one read in
        place (:func:`transposes_in_place`), that ``value`` is."""
        owner = value.owner
        if getattr(owner, "name", None) == "ac.page_view" and owner.operands[0] in func.args:
            return owner
        return owner if value in views else None

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
        """Every op reading ``value`` can take 16-bit patterns: tile loads, a fused reduction, such an
        append or page view, and (for an argument, handed back as it came) the return."""
        allowed = tile_loads | fused | ({id(func.body.ops[-1])} if value in func.args else set())
        return all(id(op) in allowed or bool(op.results) and keeps_patterns(op) for op in readers.get(value, []))

    def keeps_patterns(op: Op) -> bool:
        return appended(op.results[0]) is not None or paged(op.results[0]) is not None

    def as_patterns(value, cached: bool) -> bool:
        """Whether a tile source can be read as patterns: its memory read as patterns alone, or (in a
        grid reading a decoder's cache) computed, and rounded into a 16-bit copy."""
        if computed(value):
            return cached
        return read_as_patterns(value) and all(map(read_as_patterns, origins(value)))

    lanes = {"ac.tile_grid": fixed_lanes, "ac.key_grid": backward_lanes}
    chosen = [choose(op, fixed_lanes=lanes[op.name]) for op in grids]
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
    found = [choose(op, "bits", lanes[op.name]) if k in bits else chosen[k] for k, op in enumerate(grids)]
    kept = {func.args.index(a) for k in bits for a in args_of[k]}
    # where a grid reads patterns, a bf16 argument that fused reductions (and the return) alone read
    # is kept too: the backward's saved output, which only delta's reduction reads beside d_out
    for op in func.body.ops:
        if id(op) in fused:
            for value in op.operands:
                if value in func.args and value.type.dtype == "bf16" and read_as_patterns(value) and kept:
                    kept.add(func.args.index(value))
    forward = [c for c, op in zip(found, grids) if op.name == "ac.tile_grid"]
    backward = [c for c, op in zip(found, grids) if op.name == "ac.key_grid"]
    return forward, frozenset(kept), backward


def bf16_outputs(module: Module) -> list[bool]:
    """Per ``ac.tile_grid``: whether its kernel writes its output as bf16 patterns (uint16, rounded
    to nearest even in the kernel): the output is declared bf16 and the function returns it (or its
    transpose, written in place: :func:`outputs_in_place`), which nothing else reads.  Half the bytes
    a float32 output writes, and no rounding pass after."""
    from attncomp.backends.numba_cuda.host.views import outputs_in_place

    func = module.main
    ret = func.body.ops[-1]
    readers: dict = {}
    for op in func.body.walk():
        for value in op.operands:
            readers.setdefault(value, []).append(op)
    viewed = outputs_in_place(func)
    found = []
    for op in func.body.ops:
        if op.name == "ac.tile_grid":
            out = op.results[0]
            returned = all(r is ret for r in readers.get(out, [])) or out in viewed
            found.append(out.type.dtype == "bf16" and returned)
    return found
