"""``fn.decoder(max_len)``: incremental decoding with a preallocated key/value cache.

The decoder runs the spec compiled through kv-cache-reuse: each call takes
the new tokens' inputs, computes their keys and values, attends over every
cached position plus the new ones (positions are absolute), and appends the
new keys and values to its cache.  Inputs are checked before any work; a
call that would overflow ``max_len`` or has wrong shapes leaves the cache
exactly as it was.

On the ``cuda`` backend the cache lives on the GPU: each step's kernels
append to it in place, and only the new tokens' inputs and outputs cross
the bus (outputs come back to the host when the inputs came from it).
``dec.cache`` then gives device arrays.

With ``cache="f8e4m3"`` (or ``"f8e5m2"``) the cache holds 8-bit codes and a
float32 scale per (token, head): new keys and values are quantised as they
are appended and the attention reads them dequantised (``ir.quantized``);
``dec.cache`` then gives ``k_cache``, ``k_scale``, ``v_cache`` and
``v_scale``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from attncomp.compilation import Compilation
from attncomp.ir.binding import REMEMBERED_KEYS, bind_shapes
from attncomp.ir.quantized import quantize
from attncomp.ir.types import CACHE_DTYPES, NUMPY_DTYPES
from attncomp.passes.pipeline import edit_pipeline, make_pass, pass_names


def cache_type(cache: Any) -> str:
    """The ``cache=`` option as an element type name: "" (the keys' own type), "f8e4m3" or "f8e5m2"
    (``ac.f8e4m3``, ``ac.f8e5m2`` or their names); anything else is a ``ValueError`` naming it."""
    if cache is None:
        return ""
    name = getattr(cache, "name", cache)
    if name not in CACHE_DTYPES:
        raise ValueError(f"cache: an 8-bit cache type is one of {', '.join(CACHE_DTYPES)} (or None), got {cache!r}")
    return name


def decoding_compilation(c: Compilation, backend: str | None = None, cache: str = "") -> Compilation:
    """``c``'s input compiled with kv-cache-reuse right after softmax-fusion (once per backend and
    cache type)."""

    def make() -> Compilation:
        passes = c.passes
        reuse = make_pass("kv-cache-reuse", cache=cache)
        if "kv-cache-reuse" in pass_names(passes):
            passes = edit_pipeline(passes, replace=reuse)
        else:
            if "softmax-fusion" not in pass_names(passes):
                passes = [make_pass("softmax-fusion"), *passes]
            passes = edit_pipeline(passes, insert=reuse, after="softmax-fusion")
        return c.derive(passes, backend=backend)

    return c.variant(("decoding", backend or c.backend, cache), make)


class Decoder:
    """Callable decoder over one cache.  See ``CompiledFunction.decoder``."""

    def __init__(
        self, fn: Compilation | None, max_len: int, choose: Callable[[tuple[Any, ...]], Compilation] | None = None
    ):
        """``fn``: the decoding compilation; or None and ``choose``, which picks it from the first
        call's inputs (a generic spec's decoder takes that call's float type)."""
        if max_len <= 0:
            raise ValueError(f"max_len must be positive, got {max_len}")
        self.max_len = int(max_len)
        self.choose = choose
        self.fn: Compilation | None = None
        self._buffers: list[Any] | None = None
        self.length = 0
        if fn is not None:
            self._use(fn)

    def _use(self, fn: Compilation) -> None:
        self.fn = fn
        func = fn.func
        self._cached = func.attrs["cached_length"]
        #: the caches' 8-bit type ("" for none): each cache then has its scales after it
        self._quantized = func.attrs.get("cache_type", "")
        #: one cache (keys) where the values are the keys' first features (MLA's latent), else two
        caches = func.attrs["cache_results"]
        self._n_inputs = len(func.args) - caches * (2 if self._quantized else 1)
        self._cache_args = func.args[self._n_inputs :]
        self._n_outputs = len(func.results) - func.attrs["cache_results"]
        self._axis = self._cache_args[0].type.rank - 2
        self._new_keys = func.results[self._n_outputs]  # the spec's k: its sequence size is the new count
        #: (shape, dtype) of each input -> the sizes they bind (steps whose shapes repeat bind once);
        #: kept only where the inputs' shapes do not name the cached length
        inputs = func.args[: self._n_inputs]
        names = {s for a in inputs for d in a.type.shape for s in d.symbols()}
        self._shapes: dict[tuple, dict[str, int]] | None = {} if self._cached.symbol not in names else None

    @property
    def cache(self) -> dict[str, Any]:
        """The cached keys and values (views of the first ``length`` positions; device arrays on cuda),
        and for an 8-bit cache their scales."""
        if self._buffers is None:
            return {}
        index = [slice(None)] * (self._axis + 1)
        index[self._axis] = slice(0, self.length)
        program = self.fn.program
        return {arg.name: program.sliced(buf, tuple(index)) for arg, buf in zip(self._cache_args, self._buffers)}

    def reset(self) -> None:
        """Forget every cached position (the buffers are kept)."""
        self.length = 0

    def __call__(self, *inputs: Any):
        if self.fn is not None:
            return self._step(inputs)
        self._use(self.choose(inputs))
        try:
            return self._step(inputs)
        except Exception:
            self.fn = None  # a first call that failed fixes nothing
            raise

    def _step(self, inputs: tuple[Any, ...]):
        if len(inputs) != self._n_inputs:
            names = ", ".join(a.name for a in self.fn.func.args[: self._n_inputs])
            raise TypeError(f"the decoder takes {self._n_inputs} inputs ({names}), got {len(inputs)}")
        program = self.fn.program
        on_device = program.cache_on_device
        # shapes are read without copying device inputs; the backend binds them
        checked = [program.shape_view(x, a.name) for x, a in zip(inputs, self.fn.func.args)]
        arrays = list(inputs) if on_device else checked
        sizes = {self._cached.symbol: self.length}
        env = self._input_sizes(checked, sizes)
        new = self._new_keys.type.shape[self._axis].evaluate(env)
        if self.length + new > self.max_len:
            raise ValueError(
                f"appending {new} positions to a cache holding {self.length} exceeds max_len = {self.max_len}; "
                "the cache is unchanged"
            )
        if self._buffers is None:
            self._buffer_count = 0  # the cache arguments follow the inputs, in the order of the new entries
            new_entries = self.fn.func.results[self._n_outputs :]
            self._buffers = [buf for value in new_entries for buf in self._allocate(value, env)]
        results = self.fn.run([*arrays, *self._buffers], sizes)
        outputs, new_kv = results[: self._n_outputs], results[self._n_outputs :]
        if on_device:  # the kernels appended to the device cache in place
            outputs = program.outputs_for(outputs, inputs)
        elif not program.appends_in_place:  # the interpreter returns the new entries
            index = [slice(None)] * (self._axis + 1)
            index[self._axis] = slice(self.length, self.length + new)
            stored = [quantize(x, self._quantized) for x in new_kv] if self._quantized else [(x,) for x in new_kv]
            for buf, value in zip(self._buffers, [part for parts in stored for part in parts]):
                buf[tuple(index[: buf.ndim])] = value
        self.length += new
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    def _input_sizes(self, checked: list[Any], sizes: dict[str, int]) -> dict[str, int]:
        """The sizes the inputs bind, with the cached length: checked the full way for shapes not
        seen before (errors name the argument), remembered by the inputs' shapes and dtypes."""
        args = self.fn.func.args[: self._n_inputs]
        if self._shapes is None:
            return bind_shapes(args, checked, sizes)
        key = tuple((x.shape, x.dtype) for x in checked)
        bound = self._shapes.get(key)
        if bound is None:
            bound = bind_shapes(args, checked, {})
            if len(self._shapes) < REMEMBERED_KEYS:
                self._shapes[key] = bound
        return {**bound, **sizes}

    def _allocate(self, new_entries, env: dict[str, int]) -> list[Any]:
        """A zeroed cache shaped like the new keys (or values), ``max_len`` long; an 8-bit one with
        its scales."""
        shape = [d.evaluate(env) for d in new_entries.type.shape]
        shape[self._axis] = self.max_len
        if self._quantized:
            stored = [(tuple(shape), NUMPY_DTYPES[self._quantized]), (tuple(shape[:-1]), NUMPY_DTYPES["f32"])]
        else:
            stored = [(tuple(shape), NUMPY_DTYPES[new_entries.type.dtype])]
        buffers = []
        for buffer_shape, dtype in stored:
            arg = self._n_inputs + self._buffer_count
            self._buffer_count += 1
            buffers.append(self.fn.program.zeros(buffer_shape, dtype, arg))
        return buffers

    def __repr__(self) -> str:
        name = self.fn.name if self.fn is not None else "(float type of the first call)"
        return f"<attncomp decoder {name}: {self.length}/{self.max_len} positions cached>"
