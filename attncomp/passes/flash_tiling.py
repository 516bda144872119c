"""flash-tiling: ``ac.attention`` becomes loops over query and key blocks.

One ``ac.tile_grid`` program per batch position and block of ``block_q``
queries loads its query tile and runs an ``ac.tile_for`` over key blocks of
``block_k`` keys carrying the online-softmax state ``(m, l, acc)``:

    s    = score(q_tile @ k_tileᵀ)  masked by the mask and by j < S
    m'   = max(m, rowmax(s));  p = exp(s - m');  alpha = exp(m - m')
    l'   = alpha * l + rowsum(p);  acc' = alpha * acc + p @ v_tile
                                    (p * weight(...) @ v_tile with a weight region: dropout)

then ``out = acc / l`` and ``lse = m + log(l)``; an unnormalised attention (``normalized = false``:
sigmoid attention, ``exp(s)`` the logistic function) gives ``out = acc * exp(m)``.  A row that saw no visible
key has ``l = 0``: its output is 0 and its LSE ``-inf`` (``m`` is replaced
by 0 while it is still ``-inf`` so no ``-inf - -inf`` arises).  Tiles at the
end of a sequence are padded; padded query rows reuse the last row's
position and are dropped on store.  Nothing of size T x S is built.
"""

from __future__ import annotations

from dataclasses import dataclass

from attncomp.ir.core import Block, Module, Op, Value
from attncomp.ir.dims import dim
from attncomp.ir.graph import remove_dead_ops
from attncomp.ir.ops.attention import normalized, with_max
from attncomp.ir.ops.elementwise import promote
from attncomp.ir.ops.tile import PRECISIONS
from attncomp.ir.types import TensorType, accumulation_dtype
from attncomp.passes.backward_tiling import tile_attention_grad
from attncomp.passes.base import Pass, register_pass
from attncomp.passes.builder import Builder
from attncomp.passes.gather_bounds import guard_gathers
from attncomp.passes.rewrite import replace_uses
from attncomp.passes.tile_building import grid_region, kv_head_of, load_rows, named, positions, retyped_region

#: key blocks per part of a batch-invariant grid's key split (1024 keys at the CPU's blocks of 128)
SPLIT_BLOCKS = 8


def key_split_of(block_k: int) -> int:
    """A batch-invariant grid's part length in keys: ``SPLIT_BLOCKS`` key blocks."""
    return SPLIT_BLOCKS * block_k


@dataclass
class TileConfig:
    block_q: int
    block_k: int
    acc: str  # the accumulation dtype


def _key_loop(
    attn: Op, cfg: TileConfig, grid_index: list[Value], q_tile: Value, rows: Value, kv_head: Value | None
) -> Block:
    q, k, v = attn.operands
    bq, bk, acc = cfg.block_q, cfg.block_k, cfg.acc
    length = k.type.shape[-2]
    body = Block()
    kb = body.add_arg(TensorType((), "i64"), "kb")
    m = body.add_arg(TensorType.of((bq, 1), acc), "m")
    lsum = body.add_arg(TensorType.of((bq, 1), acc), "l")
    acc_in = body.add_arg(TensorType.of((bq, v.type.shape[-1]), acc), "acc")
    b = Builder(body)
    j0 = named(b.emit("ac.mul", kb, b.const(bk, "i64")), "j0")
    k_tile = load_rows(b, k, grid_index, kv_head, j0, bk, acc)
    v_tile = load_rows(b, v, grid_index, kv_head, j0, bk, acc)
    raw = named(b.emit("ac.matmul", q_tile, b.emit("ac.transpose", k_tile, perm=[1, 0])), "qk")
    cols_raw, cols = positions(b, j0, bk, 1, length)
    in_bounds = named(b.emit("ac.cmp", cols_raw, b.dim(length), pred="lt"), "in_bounds")
    index_types = [TensorType((), "i64")] * (len(grid_index) + 2)
    score_region = retyped_region(attn.regions[0], index_types + [TensorType((), acc)], [acc])
    mask_region = retyped_region(attn.regions[1], index_types, ["i1"])
    tile = TensorType.of((bq, bk), acc)
    scores = b.op("ac.map", [*grid_index, rows, cols, raw], {"role": "score"}, [tile], [score_region]).result
    visible = b.op("ac.map", [*grid_index, rows, cols], {"role": "mask"}, [tile.with_dtype("i1")], [mask_region]).result
    visible = named(b.emit("ac.and", visible, in_bounds), "visible")
    s = named(b.emit("ac.where", visible, named(scores, "s"), b.const(float("-inf"), acc)), "s_masked")
    # online softmax update
    m_new = named(
        b.emit("ac.maximum", m, b.op("ac.reduce", [s], {"kind": "max", "axes": [1], "keepdims": True}).result),
        "m_new",
    )
    m_safe = named(
        b.emit(
            "ac.where",
            b.emit("ac.cmp", m_new, b.const(float("-inf"), acc), pred="eq"),
            b.const(0.0, acc),
            m_new,
        ),
        "m_safe",
    )
    p = named(b.emit("ac.exp", b.emit("ac.sub", s, m_safe)), "p")
    alpha = named(b.emit("ac.exp", b.emit("ac.sub", m, m_safe)), "alpha")
    row_sum = b.op("ac.reduce", [p], {"kind": "sum", "axes": [1], "keepdims": True}).result
    l_new = named(b.emit("ac.add", b.emit("ac.mul", alpha, lsum), row_sum), "l_new")
    if len(attn.regions) == 3:  # a weight on the probabilities (dropout): after their sum, before @ v
        weight_region = retyped_region(attn.regions[2], index_types, [acc])
        weight = b.op("ac.map", [*grid_index, rows, cols], {"role": "weight"}, [tile], [weight_region]).result
        p = named(b.emit("ac.mul", p, named(weight, "w")), "p_weighted")
    acc_new = named(b.emit("ac.add", b.emit("ac.mul", alpha, acc_in), b.emit("ac.matmul", p, v_tile)), "acc_new")
    b.yield_(m_new, l_new, acc_new)
    return body


def tile_attention(
    block: Block, attn: Op, block_q: int, block_k: int, precision: str = "exact", key_split: int | None = None
) -> Op:
    q, k, v = attn.operands
    out_type = attn.results[0].type
    acc = accumulation_dtype(promote([q.type, k.type, v.type]))
    cfg = TileConfig(block_q, block_k, acc)
    nb = out_type.rank - 2
    grid, grid_index, i0 = grid_region(nb, "i0")
    b = Builder(grid)
    kv_repeat = dim(attn.attrs["kv_repeat"])
    kv_head = kv_head_of(b, grid_index, kv_repeat)
    q_tile = named(load_rows(b, q, grid_index, None, i0, block_q, acc), "q_tile")
    _, rows = positions(b, i0, block_q, 0, q.type.shape[-2])
    e = v.type.shape[-1]
    init = [
        b.const(float("-inf"), acc, (block_q, 1)),
        b.const(0.0, acc, (block_q, 1)),
        b.const(0.0, acc, (block_q, e)),
    ]
    n_blocks = named(b.dim((k.type.shape[-2] + (block_k - 1)) // block_k), "n_kv_blocks")
    extent = (k.type.shape[-2] + (block_k - 1)) // block_k
    loop = b.op(
        "ac.tile_for",
        [b.const(0, "i64"), n_blocks, *init],
        {"block_k": block_k, "extent": extent},
        regions=[_key_loop(attn, cfg, grid_index, q_tile, rows, kv_head)],
    )
    m, lsum, acc_out = (named(r, n) for r, n in zip(loop.results, ("m", "l", "acc")))
    if normalized(attn):
        empty = b.emit("ac.cmp", lsum, b.const(0.0, acc), pred="eq")
        l_safe = b.emit("ac.where", empty, b.const(1.0, acc), lsum)
        out_tile = b.emit("ac.div", acc_out, l_safe)
    else:  # sum exp(s) v = acc exp(m); a row with no visible key has m = -inf and acc = 0
        out_tile = b.emit("ac.mul", acc_out, b.emit("ac.exp", m))
    tiles = [named(b.cast(out_tile, out_type.dtype), "out_tile")]
    if attn.attrs["with_lse"]:
        lse = b.emit("ac.add", m, b.emit("ac.log", lsum))
        lse = b.op("ac.reshape", [lse], declared=[TensorType.of((block_q,), acc)]).result
        tiles.append(named(b.cast(lse, attn.results[1].type.dtype), "lse_tile"))
    if with_max(attn):  # the running max is each row's largest visible score (-inf where none is)
        top = b.op("ac.reshape", [m], declared=[TensorType.of((block_q,), acc)]).result
        tiles.append(named(b.cast(top, attn.results[-1].type.dtype), "max_tile"))
    b.yield_(*tiles)
    at = block.ops.index(attn)
    grid_attrs: dict = {"block_q": block_q}
    if precision != "exact":
        grid_attrs["precision"] = precision
    if kv_repeat != dim(1):
        grid_attrs["kv_repeat"] = attn.attrs["kv_repeat"]
    if key_split is not None:
        grid_attrs["key_split"] = key_split
    if with_max(attn):
        grid_attrs["with_max"] = True
    if not normalized(attn):
        grid_attrs["normalized"] = False
    if "score_bound" in attn.attrs:
        grid_attrs["score_bound"] = attn.attrs["score_bound"]
    grid_op = Builder(block, at).op(
        "ac.tile_grid",
        [],
        grid_attrs,
        [r.type for r in attn.results],
        [grid],
        [r.name for r in attn.results],
    )
    replace_uses(block, dict(zip(attn.results, grid_op.results)))
    return grid_op


#: the float types of a 16-bit forward tile (``FlashTiling.block_q_16bit``)
SIXTEEN_BIT = frozenset({"f16", "bf16"})


@register_pass
@dataclass
class FlashTiling(Pass):
    name = "flash-tiling"
    summary = "turn ac.attention into query/key block loops with online softmax"
    block_q: int = 64
    block_k: int = 64
    #: query rows of a forward tile whose query, key and value are all 16-bit (f16 or bf16); 0: ``block_q``.
    #: The cuda backend's default takes 128 (``passes.default_pipeline("cuda")``): a thread block of
    #: four warps of 32 rows then shares each key and value chunk, as FlashAttention-2's does, where float32
    #: operands (their 3xTF32 kernel's shared memory) keep 64
    block_q_16bit: int = 0
    #: how float32 tile products may be computed (``ac.tile_grid``'s ``precision``): "exact"
    #: (float32-accurate), "tf32" (opt-in: inputs rounded to tf32, relative errors near 1e-3, on
    #: tensor cores where the backend has them), "ieee" (float32 FMAs, never tensor cores)
    precision: str = "exact"
    #: the backward's ``ac.key_grid`` sums its gradients in an order fixed from run to run
    #: (``deterministic = true`` in the IR): bit-identical gradients on backends whose default
    #: order varies (CUDA's atomics); the forward is deterministic either way
    deterministic: bool = False
    #: every row's sums in an order fixed by the row alone (``key_split = N`` on ``ac.tile_grid``): its
    #: keys split into parts at multiples of ``N`` positions (:func:`key_split_of`), never by the
    #: launch's size, each part's state merged in part order; the same bits whatever the batch.  Its
    #: backward is ``deterministic`` too: gradients summed in an order that varies from run to run
    #: could not be a sequence's own bits
    batch_invariant: bool = False

    def run(self, module: Module, remarks: list[str]) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"flash-tiling: precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        for func in module.funcs:
            for op in [o for o in func.body.ops if o.name == "ac.attention"]:
                guard_gathers(func.body, op)
                split = key_split_of(self.block_k) if self.batch_invariant else None
                block_q = self.block_q
                if self.block_q_16bit and {x.type.dtype for x in op.operands} <= SIXTEEN_BIT:
                    block_q = self.block_q_16bit
                tile_attention(func.body, op, block_q, self.block_k, self.precision, split)
            for op in [o for o in func.body.ops if o.name == "ac.attention_grad"]:
                guard_gathers(func.body, op)
                ordered = self.deterministic or self.batch_invariant
                if tile_attention_grad(func.body, op, self.block_q, self.block_k, ordered, self.precision) is None:
                    remarks.append("flash-tiling: ac.attention_grad with q broadcast over batch axes is not tiled")
            remove_dead_ops(func.body)
