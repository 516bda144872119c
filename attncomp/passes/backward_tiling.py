"""How flash-tiling tiles ``ac.attention_grad``: FlashAttention-2's backward loop nest.

    delta = rowsum(d_out * out) - d_lse                 # once per call, O(T)
    for each batch position and block of keys j0:       # ac.key_grid, one program each
        k_tile, v_tile = keys and values j0 .. j0 + block_k
        dq_part = 0 [T x D];  dk = 0, dv = 0 [block_k x .]
        for each block of queries i0:                   # ac.tile_for over query blocks
            s  = score(q_tile @ k_tileᵀ), visible = mask & in bounds
            p  = exp(s - lse) where visible
            ds = p * (d_out_tile @ v_tileᵀ - delta)          # (d_out_tile @ v_tileᵀ) * w with a weight w
            ds_raw, site contributions = gradient(s, ds)     # the score's derivative
            dq_part[i0 ..] += ds_raw @ k_tile
            dk += ds_rawᵀ @ q_tile;  dv += pᵀ @ d_out_tile    # (p * w)ᵀ with a weight
            site += contributions added at their indices
        yield dq_part, dk, dv, sites

An unnormalised attention (``normalized = false``: sigmoid attention, ``P = exp(s)``) reads zeros
for both ``lse`` and ``delta``: ``dS = P * dP``.

Each program keeps its key block's ``dk`` and ``dv`` in locals; ``dq`` is a
per-program partial that the grid adds up at the program's batch position
(no two programs write one location at once, so no atomics are needed: a
backend runs the programs of one batch position in order, or keeps partials).
Nothing of size T x S is built.
"""

from __future__ import annotations

from attncomp.ir.core import Block, Op, Value
from attncomp.ir.dims import dim
from attncomp.ir.ops.attention import normalized
from attncomp.ir.ops.elementwise import promote
from attncomp.ir.types import TensorType, accumulation_dtype
from attncomp.passes.builder import Builder
from attncomp.passes.patterns import constant_value
from attncomp.passes.rewrite import replace_uses
from attncomp.passes.tile_building import grid_region, kv_head_of, load_rows, named, positions, retyped_region


def _with_row_axis(b: Builder, x: Value) -> Value:
    """``[..., T]`` as ``[..., T, 1]`` so that it loads as tiles of rows."""
    return b.op("ac.reshape", [x], declared=[x.type.with_shape((*x.type.shape, dim(1)))]).result


def tile_attention_grad(
    block: Block, op: Op, block_q: int, block_k: int, deterministic: bool = False, precision: str = "exact"
) -> Op | None:
    """Replace ``op`` by an ``ac.key_grid``; None (untouched) when q is broadcast over batch axes.
    ``deterministic`` marks the grid ``deterministic = true``: its sums in an order fixed from run to run;
    ``precision`` other than "exact" is kept on the grid (flash-tiling's: "tf32" lets float32 products
    run on tensor cores)."""
    q, k, v, out, lse, d_out, d_lse = op.operands
    if q.type.shape[:-2] != out.type.shape[:-2]:
        return None
    dq_type, dk_type, dv_type = (r.type for r in op.results[:3])
    sites = op.results[3:]
    acc = accumulation_dtype(promote([q.type, k.type, v.type]))
    at = block.ops.index(op)
    top = Builder(block, at)
    # in the accumulation type from the start: dS = P (dP - delta) sums to zero over a row only as
    # far as delta is exact, and a site's gradient (ALiBi's slopes) weighs each row's error by its
    # distances, so a delta rounded to bf16 throws a slope's gradient off by tens of percent
    if normalized(op):
        product = top.emit("ac.mul", top.cast(d_out, acc), top.cast(out, acc))
        delta = top.op("ac.reduce", [product], {"kind": "sum", "axes": [out.type.rank - 1], "keepdims": True}).result
        if constant_value(d_lse) != 0.0:  # the spec's LSE has a cotangent
            delta = top.emit("ac.sub", delta, _with_row_axis(top, top.cast(d_lse, acc)))
        delta = named(top.cast(delta, acc), "delta")
        lse_rows = _with_row_axis(top, lse)
    else:  # P = exp(s), not divided by a row's sum: no LSE to subtract, no delta
        rows = (*out.type.shape[:-1], dim(1))
        delta = named(top.const(0.0, acc, rows), "delta")
        lse_rows = top.const(0.0, lse.type.dtype, rows)

    nb = dq_type.rank - 2
    grid, grid_index, j0 = grid_region(nb, "j0")
    g = Builder(grid)
    kv_head = kv_head_of(g, grid_index, dim(op.attrs["kv_repeat"]))
    k_tile = named(load_rows(g, k, grid_index, kv_head, j0, block_k, acc), "k_tile")
    v_tile = named(load_rows(g, v, grid_index, kv_head, j0, block_k, acc), "v_tile")
    keys = k.type.shape[-2]
    cols_raw, cols = positions(g, j0, block_k, 1, keys)
    key_in_bounds = named(g.emit("ac.cmp", cols_raw, g.dim(keys), pred="lt"), "key_in_bounds")
    site_types = [s.type.with_dtype(acc) for s in sites]
    init = [
        g.const(0.0, acc, tuple(dq_type.shape[nb:])),
        g.const(0.0, acc, (block_k, dk_type.shape[-1])),
        g.const(0.0, acc, (block_k, dv_type.shape[-1])),
        *(g.const(0.0, acc, tuple(t.shape)) for t in site_types),
    ]
    rows_total = q.type.shape[-2]
    extent = (rows_total + (block_q - 1)) // block_q
    n_blocks = named(g.dim(extent), "n_q_blocks")
    body = _query_loop(op, acc, block_q, grid_index, k_tile, v_tile, cols, key_in_bounds, [q, d_out, lse_rows, delta])
    loop = g.op(
        "ac.tile_for",
        [g.const(0, "i64"), n_blocks, *init],
        {"block_q": block_q, "extent": extent},
        regions=[body],
    )
    dq_part, dk_acc, dv_acc, *site_accs = loop.results
    g.yield_(
        g.cast(dq_part, dq_type.dtype),
        g.cast(dk_acc, dk_type.dtype),
        g.cast(dv_acc, dv_type.dtype),
        *(g.cast(s, r.type.dtype) for s, r in zip(site_accs, sites)),
    )
    attrs = {"block_k": block_k, "kv_repeat": op.attrs["kv_repeat"]}
    if deterministic:
        attrs["deterministic"] = True
    if precision != "exact":
        attrs["precision"] = precision
    grid_op = Builder(block, block.ops.index(op)).op(
        "ac.key_grid", [], attrs, [r.type for r in op.results], [grid], [r.name for r in op.results]
    )
    replace_uses(block, dict(zip(op.results, grid_op.results)))
    return grid_op


def _query_loop(
    op: Op,
    acc: str,
    block_q: int,
    grid_index: list[Value],
    k_tile: Value,
    v_tile: Value,
    cols: Value,
    key_in_bounds: Value,
    row_inputs: list[Value],
) -> Block:
    q, d_out, lse_rows, delta = row_inputs
    score_region, mask_region, grad_region, *weights = op.regions
    weight_region = weights[0] if weights else None
    sites = op.results[3:]
    body = Block()
    qb = body.add_arg(TensorType((), "i64"), "qb")
    carried = [
        body.add_arg(TensorType.of(tuple(op.results[0].type.shape[-2:]), acc), "dq"),
        body.add_arg(k_tile.type, "dk"),
        body.add_arg(v_tile.type, "dv"),
        *(body.add_arg(s.type.with_dtype(acc), s.name or "site") for s in sites),
    ]
    b = Builder(body)
    i0 = named(b.emit("ac.mul", qb, b.const(block_q, "i64")), "i0")

    def rows_of(x: Value, name: str) -> Value:
        return named(load_rows(b, x, grid_index, None, i0, block_q, acc), name)

    q_tile = rows_of(q, "q_tile")
    do_tile = rows_of(d_out, "d_out_tile")
    lse_tile = rows_of(lse_rows, "lse_tile")
    delta_tile = rows_of(delta, "delta_tile")
    rows_raw, rows = positions(b, i0, block_q, 0, q.type.shape[-2])
    row_in_bounds = b.emit("ac.cmp", rows_raw, b.dim(q.type.shape[-2]), pred="lt")
    qk = named(b.emit("ac.matmul", q_tile, b.emit("ac.transpose", k_tile, perm=[1, 0])), "qk")
    index = [TensorType((), "i64")] * (len(grid_index) + 2)
    scalar = TensorType((), acc)
    tile = qk.type
    score = retyped_region(score_region, index + [scalar], [acc])
    mask = retyped_region(mask_region, index, [None])
    n_yield = len(grad_region.ops[-1].operands)
    floats = [True] + [False] * (n_yield - 1)
    at = 1
    for site in sites:
        floats[at] = True
        at += 1 + site.type.rank
    gradient = retyped_region(grad_region, index + [scalar, scalar], [acc if f else None for f in floats])
    s = named(b.op("ac.map", [*grid_index, rows, cols, qk], {"role": "score"}, [tile], [score]).result, "s")
    visible = b.op("ac.map", [*grid_index, rows, cols], {"role": "mask"}, [tile.with_dtype("i1")], [mask]).result
    visible = named(b.emit("ac.and", b.emit("ac.and", visible, key_in_bounds), row_in_bounds), "visible")
    zero = b.const(0.0, acc)
    p = named(b.emit("ac.where", visible, b.emit("ac.exp", b.emit("ac.sub", s, lse_tile)), zero), "p")
    dp = named(b.emit("ac.matmul", do_tile, b.emit("ac.transpose", v_tile, perm=[1, 0])), "dp")
    p_v = p  # what multiplies d_out into dv: the probabilities, weighted as the forward's were
    if weight_region is not None:  # dropout: dP and dV see the weighted probabilities, delta does not
        weight_region = retyped_region(weight_region, index, [acc])
        w = named(b.op("ac.map", [*grid_index, rows, cols], {"role": "weight"}, [tile], [weight_region]).result, "w")
        dp = named(b.emit("ac.mul", dp, w), "dp_weighted")
        p_v = named(b.emit("ac.mul", p, w), "p_weighted")
    ds = named(b.emit("ac.mul", p, b.emit("ac.sub", dp, delta_tile)), "ds")
    grad_types = [tile] + [tile.with_dtype(acc if f else "i64") for f in floats[1:]]
    grads = b.op("ac.map", [*grid_index, rows, cols, qk, ds], {"role": "gradient"}, grad_types, [gradient]).results
    ds_raw = named(b.emit("ac.where", visible, grads[0], zero), "ds_raw")
    dq = b.op("ac.tile_add", [carried[0], i0, b.emit("ac.matmul", ds_raw, k_tile)]).result
    dk = b.emit("ac.add", carried[1], b.emit("ac.matmul", b.emit("ac.transpose", ds_raw, perm=[1, 0]), q_tile))
    dv = b.emit("ac.add", carried[2], b.emit("ac.matmul", b.emit("ac.transpose", p_v, perm=[1, 0]), do_tile))
    new_sites = []
    at = 1
    for site, acc_in in zip(sites, carried[3:]):
        contribution = b.emit("ac.where", visible, grads[at], zero)
        indices = list(grads[at + 1 : at + 1 + site.type.rank])
        added = b.op("ac.scatter_add", [contribution, *indices], declared=[acc_in.type]).result
        new_sites.append(b.emit("ac.add", acc_in, added))
        at += 1 + site.type.rank
    b.yield_(named(dq, "dq_new"), named(dk, "dk_new"), named(dv, "dv_new"), *new_sites)
    return body
