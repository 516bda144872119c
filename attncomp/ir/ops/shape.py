"""Ops that move elements without computing: transpose, reshape, slice, concat, repeat_kv.

%kt = ac.transpose %k {perm = [0, 1, 3, 2]} : tensor<B x H x D x S x f32>
%x4 = ac.reshape %x : tensor<B x T x H x (C//H) x f32>
%x1 = ac.slice %x {axis = 3, start = 0, step = 1, stop = (D//2)} : tensor<B x H x T x (D//2) x f32>
%y = ac.concat %y1, %y2 {axis = 3} : tensor<B x H x T x D x f32>
%kr = ac.repeat_kv %k {n_rep = 4} : tensor<B x (4*KV) x S x D x f32>
"""

from __future__ import annotations

from math import prod
from typing import Any

import numpy as np

from attncomp.errors import TypeCheckError
from attncomp.ir.dims import Dim, dim
from attncomp.ir.ops.base import OpDef, normalize_axis, register, require_attr, single_declared
from attncomp.ir.quantized import dequantize, quantize
from attncomp.ir.types import CACHE_DTYPES, TensorType, is_float


def _one(operands: list[TensorType], what: str) -> TensorType:
    if len(operands) != 1:
        raise TypeCheckError(f"{what}: expects 1 operand, got {len(operands)}")
    return operands[0]


@register
class Transpose(OpDef):
    """Permute axes: result axis ``k`` is operand axis ``perm[k]``."""

    name = "ac.transpose"
    attributes = {"perm": "a permutation of the axes"}

    def infer(self, operands, attrs, declared, checker):
        src = _one(operands, self.name)
        perm = require_attr(attrs, "perm", list, self.name)
        if sorted(perm) != list(range(src.rank)):
            raise TypeCheckError(f"ac.transpose: {perm} is not a permutation of {src.rank} axes")
        return [src.with_shape([src.shape[p] for p in perm])]

    def evaluate(self, op, args, ctx):
        return [np.transpose(args[0], op.attrs["perm"])]


@register
class Reshape(OpDef):
    """Reinterpret the elements (row-major) under the declared shape.

    When the element counts cannot be shown equal symbolically (``C`` against
    ``H*(C//H)``), equality is checked when the sizes are bound.
    """

    name = "ac.reshape"
    declared_result = True

    def infer(self, operands, attrs, declared, checker):
        src = _one(operands, self.name)
        result = single_declared(declared, self.name)
        if result.dtype != src.dtype:
            raise TypeCheckError("ac.reshape: the element type must not change")
        before = prod(src.shape, start=dim(1))
        after = prod(result.shape, start=dim(1))
        if before != after:
            if before.is_const and after.is_const:
                raise TypeCheckError(f"ac.reshape: cannot reshape {before.value} elements into {after.value}")
            checker.unify(before, after, "ac.reshape: element count")
        return declared

    def evaluate(self, op, args, ctx):
        shape = op.results[0].type.concrete_shape(ctx.env)
        if int(np.prod(shape)) != args[0].size:
            raise ValueError(f"ac.reshape: cannot reshape {args[0].shape} into {shape}")
        return [args[0].reshape(shape)]


@register
class Slice(OpDef):
    """``x[start:stop:step]`` along ``axis``; bounds are dimension expressions, step > 0."""

    name = "ac.slice"
    attributes = {
        "axis": "the sliced axis",
        "start": "first index (a dimension)",
        "stop": "one past the last index (a dimension)",
        "step": "a positive integer",
    }

    def infer(self, operands, attrs, declared, checker):
        src = _one(operands, self.name)
        axis = normalize_axis(require_attr(attrs, "axis", int, self.name), src.rank, self.name)
        start = dim(require_attr(attrs, "start", (int, Dim), self.name))
        stop = dim(require_attr(attrs, "stop", (int, Dim), self.name))
        step = require_attr(attrs, "step", int, self.name)
        if step <= 0:
            raise TypeCheckError(f"ac.slice: step must be positive, got {step}")
        size = (stop - start + (step - 1)) // step
        if size.is_const and size.value < 0:
            raise TypeCheckError(f"ac.slice: empty or reversed range {start}:{stop}")
        checker.require_le(dim(0), start, f"ac.slice: start of axis {axis}")
        checker.require_le(start, stop, f"ac.slice: range {start}:{stop} of axis {axis}")
        checker.require_le(stop, src.shape[axis], f"ac.slice: stop {stop} of axis {axis} (size {src.shape[axis]})")
        shape = list(src.shape)
        shape[axis] = size
        return [src.with_shape(shape)]

    def evaluate(self, op, args, ctx):
        attrs = op.attrs
        start, stop = (dim(attrs[k]).evaluate(ctx.env) for k in ("start", "stop"))
        index = [slice(None)] * args[0].ndim
        index[attrs["axis"] % args[0].ndim] = slice(start, stop, attrs["step"])
        return [args[0][tuple(index)]]


@register
class Concat(OpDef):
    """Join operands along ``axis``; the other axes must match."""

    name = "ac.concat"
    attributes = {"axis": "the joined axis"}

    def infer(self, operands, attrs, declared, checker):
        if not operands:
            raise TypeCheckError("ac.concat: needs at least one operand")
        first = operands[0]
        axis = normalize_axis(require_attr(attrs, "axis", int, self.name), first.rank, self.name)
        shape = list(first.shape)
        for other in operands[1:]:
            if other.rank != first.rank or other.dtype != first.dtype:
                raise TypeCheckError(f"ac.concat: operands {first} and {other} differ in rank or dtype")
            for k in range(first.rank):
                if k == axis:
                    shape[k] = shape[k] + other.shape[k]
                else:
                    shape[k] = checker.unify(shape[k], other.shape[k], self.name)
        return [first.with_shape(shape)]

    def evaluate(self, op, args, ctx):
        return [np.concatenate(args, axis=op.attrs["axis"])]


@register
class RepeatKV(OpDef):
    """Repeat each head ``n_rep`` times on axis 1 (grouped-query attention).

    Head ``h`` of the result is head ``h // n_rep`` of the operand.
    """

    name = "ac.repeat_kv"
    attributes = {"n_rep": "repeats per head (a dimension)"}

    def infer(self, operands, attrs, declared, checker):
        src = _one(operands, self.name)
        n_rep = dim(require_attr(attrs, "n_rep", (int, Dim), self.name))
        if src.rank < 2:
            raise TypeCheckError("ac.repeat_kv: the operand needs a head axis (axis 1)")
        shape = list(src.shape)
        shape[1] = shape[1] * n_rep
        return [src.with_shape(shape)]

    def evaluate(self, op, args, ctx):
        n_rep = dim(op.attrs["n_rep"]).evaluate(ctx.env)
        return [np.repeat(args[0], n_rep, axis=1)]


@register
class CacheAppend(OpDef):
    """The first ``length`` entries of ``cache`` along ``axis`` followed by ``new``.

    The value a decoder's attention reads: cached keys (or values) for the
    positions before this call, then the ones computed for the new tokens.
    Backends write ``new`` into the preallocated cache in place and read the
    cache directly, so nothing is concatenated; the interpreter builds the
    concatenation.  ``length + new`` must fit the cache (checked on binding).

    %kc = ac.cache_append %k_cache, %k {axis = 2, length = N_cached} : tensor<B x KV x (N_cached+T) x D x f32>

    An 8-bit cache (``f8e4m3`` or ``f8e5m2``, ``ir.quantized``) comes with its
    float32 scales, one per row (the cache's shape without its last axis):
    ``new`` is quantised as it is appended, and the view is every entry
    dequantised, in ``new``'s type:

    %kc = ac.cache_append %k_cache, %k_scale, %k {axis = 2, length = N_cached} : tensor<B x KV x (N_cached+T) x D x f32>
    """

    name = "ac.cache_append"
    attributes = {"axis": "the sequence axis", "length": "entries already cached (a dimension)"}

    def infer(self, operands, attrs, declared, checker):
        if len(operands) not in (2, 3):
            raise TypeCheckError(f"{self.name}: expects the cache (and its scales) and the new entries")
        cache, new = operands[0], operands[-1]
        axis = normalize_axis(require_attr(attrs, "axis", int, self.name), cache.rank, self.name)
        length = dim(require_attr(attrs, "length", (int, Dim), self.name))
        if len(operands) == 3:
            scales = operands[1]
            if cache.dtype not in CACHE_DTYPES or scales.dtype != "f32" or not is_float(new.dtype):
                raise TypeCheckError(
                    f"{self.name}: an 8-bit cache is {' or '.join(CACHE_DTYPES)} with f32 scales and float "
                    f"entries, got {cache}, {scales} and {new}"
                )
            if scales.rank != cache.rank - 1 or axis == cache.rank - 1:
                raise TypeCheckError(f"{self.name}: the scales {scales} need one per row of the cache {cache}")
            for c, s in zip(cache.shape, scales.shape):
                checker.unify(c, s, self.name)
        elif new.dtype != cache.dtype:
            raise TypeCheckError(f"{self.name}: the new entries {new} do not match the cache {cache}")
        if new.rank != cache.rank:
            raise TypeCheckError(f"{self.name}: the new entries {new} do not match the cache {cache}")
        shape = []
        for k, (c, n) in enumerate(zip(cache.shape, new.shape)):
            if k != axis:
                checker.unify(c, n, self.name)
            shape.append(length + n if k == axis else n)  # the computed sizes, as the rest of the IR has them
        checker.require_le(length + new.shape[axis], cache.shape[axis], f"{self.name}: cache capacity")
        return [new.with_shape(shape)]

    def evaluate(self, op, args, ctx):
        cache, new = args[0], args[-1]
        axis = op.attrs["axis"] % cache.ndim
        length = dim(op.attrs["length"]).evaluate(ctx.env)
        index = [slice(None)] * cache.ndim
        index[axis] = slice(0, length)
        cached = cache[tuple(index)]
        if len(args) == 3:  # an 8-bit cache: what is read back is every entry dequantised
            cached = dequantize(cached, args[1][tuple(index[:-1])], np.float64)
            new = dequantize(*quantize(new, op.operands[0].type.dtype), np.float64)
        return [np.concatenate([cached, new], axis=axis)]


@register
class PageView(OpDef):
    """Rows ``[0, rows)`` of sequences whose entries live in pages: row ``r`` of sequence ``b`` is
    ``pages[table[b, r // P], ..., r % P, :]``.

    ``pages`` is ``[num_pages, *heads, P, d]`` (a paged decoder's pool: each
    head's rows of a page contiguous) and ``table`` each sequence's page
    numbers, in order: ``[entries]`` for one sequence, ``[batch, entries]``
    for several.  The view is ``[batch, *heads, rows, d]`` (batch 1 for one
    sequence), the layout attention reads.  Backends read the pages through
    the table where the view is tiled, so nothing is copied; the interpreter
    builds the view.  Page numbers are checked before use.

    %k = ac.page_view %k_pages, %page_table {rows = k_rows} : tensor<1 x KV x k_rows x D x f32>

    8-bit pages (``f8e4m3`` or ``f8e5m2``, ``ir.quantized``) come with their
    float32 scales after the table, one per row (``[num_pages, *heads, P]``,
    the same page indexing), and the view is every row dequantised (codes times
    scale), in the declared float type:

    %k = ac.page_view %k_pages, %page_table, %k_scales {rows = k_rows} : tensor<1 x KV x k_rows x D x f32>

    With ``slot = 1`` a page holds its rows before the heads, ``[num_pages, P,
    *heads, d]`` (FlashAttention's and vLLM's page layout: a row's heads
    together); the view is the same ``[batch, *heads, rows, d]``:

    %k = ac.page_view %k_pages, %block_table {rows = (E*P), slot = 1} : tensor<B x KV x (E*P) x D x bf16>
    """

    name = "ac.page_view"
    attributes = {
        "rows": "the rows seen (a dimension)",
        "slot": "optional: the pages' axis of a page's rows, 1 or (the default) the one before the features",
    }
    #: the result's element type: the pages' own, or, for 8-bit pages, the float type they are read in
    declared_result = True

    def infer(self, operands, attrs, declared, checker):
        if len(operands) not in (2, 3):
            raise TypeCheckError(f"{self.name}: expects the pages, the page table (and the pages' scales)")
        pages, table = operands[:2]
        rows = dim(require_attr(attrs, "rows", (int, Dim), self.name))
        if pages.rank < 3 or table.rank not in (1, 2) or not table.dtype.startswith("i"):
            raise TypeCheckError(
                f"{self.name}: expects pages [num_pages, ..., page_size, d] and an integer table of rank 1 or 2"
            )
        batch = table.shape[0] if table.rank == 2 else dim(1)
        slot = page_slot(attrs, pages.rank)
        if slot not in (1, pages.rank - 2):
            raise TypeCheckError(f"{self.name}: slot is 1 or {pages.rank - 2} (the pages' axis of a page's rows)")
        heads = [size for axis, size in enumerate(pages.shape[1:-1], start=1) if axis != slot]
        view = pages.with_shape((batch, *heads, rows, pages.shape[-1]))
        if len(operands) == 2:
            if pages.dtype in CACHE_DTYPES:
                raise TypeCheckError(f"{self.name}: 8-bit pages {pages} need their scales after the page table")
            return [view]
        scales = operands[2]
        if pages.dtype not in CACHE_DTYPES or scales.dtype != "f32":
            raise TypeCheckError(
                f"{self.name}: 8-bit pages are {' or '.join(CACHE_DTYPES)} with f32 scales, got {pages} and {scales}"
            )
        if scales.rank != pages.rank - 1:
            raise TypeCheckError(f"{self.name}: the scales {scales} need one per row of the pages {pages}")
        if slot != pages.rank - 2:
            raise TypeCheckError(f"{self.name}: 8-bit pages hold a page's rows after the heads (no slot attribute)")
        for p, s in zip(pages.shape, scales.shape):
            checker.unify(p, s, self.name)
        result = single_declared(declared, self.name)
        if not is_float(result.dtype):
            raise TypeCheckError(f"{self.name}: 8-bit pages are read as a float type, not {result.dtype}")
        return [view.with_dtype(result.dtype)]

    def evaluate(self, op, args, ctx):
        pages, table = args[:2]
        rows = dim(op.attrs["rows"]).evaluate(ctx.env)
        pages = np.moveaxis(pages, page_slot(op.attrs, pages.ndim), -2)  # [num_pages, *heads, P, d]
        size, heads = pages.shape[-2], pages.shape[1:-2]
        table = np.asarray(table, dtype=np.int64).reshape(-1, np.shape(table)[-1])
        check_pages(table, pages.shape[0], size, rows)
        need = -(-rows // size)

        def gather(t: np.ndarray, array: np.ndarray) -> np.ndarray:  # one sequence's rows, [*heads, rows, ...]
            rest = array.shape[len(heads) + 2 :]
            return np.moveaxis(array[t[:need]], 0, len(heads)).reshape(*heads, need * size, *rest)[
                (slice(None),) * len(heads) + (slice(0, rows),)
            ]

        if len(args) == 3:  # 8-bit pages: every row dequantised
            views = [dequantize(gather(t, pages), gather(t, args[2]), np.float64) for t in table]
        else:
            views = [gather(t, pages) for t in table]
        return [np.stack(views)]


def page_slot(attrs: dict, rank: int) -> int:
    """The axis of an ``ac.page_view``'s pages (of ``rank`` axes) that holds a page's rows: its
    ``slot`` attribute, else the one before the features."""
    return int(attrs.get("slot", rank - 2))


def rows_before_heads(view: Any) -> bool:
    """Whether an ``ac.page_view``'s pages hold a page's rows before the heads (``slot = 1``,
    ``[num_pages, P, *heads, d]``: each row's heads together, a head's rows a row of heads apart)."""
    rank = view.operands[0].type.rank
    return page_slot(view.attrs, rank) != rank - 2


def check_pages(table: np.ndarray, num_pages: int, size: int, rows: int) -> None:
    """Raise unless each table row covers ``rows`` rows of pages of ``size`` and names pages of the pool."""
    need = -(-rows // size)
    if need > table.shape[-1]:
        raise IndexError(f"ac.page_view: {rows} rows need {need} pages of {size}, the table has {table.shape[-1]}")
    used = table[..., :need]
    if used.size and (used.min() < 0 or used.max() >= num_pages):
        bad = int(used.min() if used.min() < 0 else used.max())
        raise IndexError(f"ac.page_view: page {bad} is out of range for a pool of {num_pages} pages")
