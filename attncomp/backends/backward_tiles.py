"""Reading the tiled backward that flash-tiling and mask-elimination make of ``ac.attention_grad``.

An ``ac.key_grid`` holds, per batch position and key block, a scalar
prologue (GQA head, loop bounds), the key and value tile loads, and one
``ac.tile_for`` over query blocks whose body is either the tile computation
or an ``ac.switch {tile_class = true}`` over its skipped, masked and full
variants.  The computation is recognised by its structure:

    qk = q_tile @ k_tileᵀ            dp = d_out_tile @ v_tileᵀ
    p  = where(visible, exp(s - lse_tile), 0)
    ds = p * (dp - delta_tile)
    ds_raw, (contribution, indices...) per site = gradient map(..., qk, ds)
"""

from __future__ import annotations

from dataclasses import dataclass

from attncomp.backends.tiles import LoweringError
from attncomp.ir.core import Block, Op, Value, producer


def _through_cast(value: Value) -> Value:
    """The value a chain of casts starts from."""
    op = producer(value)
    while op is not None and op.name == "ac.cast":
        value = op.operands[0]
        op = producer(value)
    return value


def _load_of(value: Value) -> Op:
    op = producer(_through_cast(value))
    if op is None or op.name != "ac.tile_load":
        raise LoweringError("unrecognised backward tile: expected a tile load")
    return op


@dataclass
class BackwardTile:
    """One variant (masked or full) of the computation of one (query block, key block) tile."""

    block: Block
    scalar_ops: list[Op]
    q_load: Op
    d_out_load: Op
    lse_load: Op
    delta_load: Op
    score: Op
    mask: Op | None  # None: every key in bounds is visible
    gradient: Op
    #: the probabilities' weight (dropout's): dp and the dv product are weighted; None: no weight
    weight: Op | None = None


def _dp(ds: Op) -> Op:
    """The product ``d_out_tile @ v_tileᵀ`` in ``ds = p * (dp - delta)``, where ``dp`` may be weighted
    (``dp * w``: attention dropout)."""
    dp = producer(producer(ds.operands[1]).operands[0])
    if dp is not None and dp.name == "ac.mul":
        dp = producer(dp.operands[0])
    if dp is None or dp.name != "ac.matmul":
        raise LoweringError("unrecognised backward tile computation: expected dp = d_out_tile @ v_tileᵀ")
    return dp


def _scalar_ops(block: Block, carried: list[Value]) -> list[Op]:
    """The tile's scalar prologue: rank-0 ops, less the sites' sums.

    A site read at no index (a learnable 0-d temperature) sums its contributions into a rank-0
    ``ac.scatter_add`` added to the loop's carried sum; those are tile work, not prologue.
    """
    tile_work = {id(v) for v in carried}
    found = []
    for op in block.ops:
        if not op.results or op.regions:
            continue
        if op.name == "ac.scatter_add" or any(id(v) in tile_work for v in op.operands):
            tile_work.update(id(r) for r in op.results)
        elif op.results[0].type.rank == 0:
            found.append(op)
    return found


def _tile(block: Block, carried: list[Value]) -> BackwardTile:
    maps = {op.attrs.get("role"): op for op in block.ops if op.name == "ac.map"}
    if "score" not in maps or "gradient" not in maps:
        raise LoweringError("unrecognised backward tile: expected score and gradient maps")
    score, gradient = maps["score"], maps["gradient"]
    qk = producer(score.operands[-1])
    ds = producer(gradient.operands[-1])
    if qk is None or qk.name != "ac.matmul" or ds is None or ds.name != "ac.mul":
        raise LoweringError("unrecognised backward tile computation")
    p = producer(ds.operands[0])
    if p is None or p.name != "ac.where":
        raise LoweringError("unrecognised backward tile computation: expected p = where(visible, exp(s - lse), 0)")
    exp = producer(p.operands[1])
    lse = producer(exp.operands[0]).operands[1]
    dp_minus_delta = producer(ds.operands[1])
    dp = _dp(ds)
    scalar_ops = _scalar_ops(block, carried)
    return BackwardTile(
        block,
        scalar_ops,
        _load_of(qk.operands[0]),
        _load_of(dp.operands[0]),
        _load_of(lse),
        _load_of(dp_minus_delta.operands[1]),
        score,
        maps.get("mask"),
        gradient,
        maps.get("weight"),
    )


@dataclass
class TiledBackward:
    grid: Op
    prologue: list[Op]
    k_load: Op
    v_load: Op
    loop: Op
    classify_ops: list[Op]
    tile_class: Value | None
    default_class: int
    masked: BackwardTile
    full: BackwardTile | None

    @property
    def block_k(self) -> int:
        return self.grid.attrs["block_k"]

    @property
    def block_q(self) -> int:
        return self.loop.attrs["block_q"]

    @property
    def batch_args(self) -> list[Value]:
        return self.grid.regions[0].args[:-1]

    @property
    def weighted(self) -> bool:
        """Whether the probabilities carry a weight region (attention dropout)."""
        return self.masked.weight is not None

    @property
    def j0(self) -> Value:
        return self.grid.regions[0].args[-1]

    @property
    def site_ranks(self) -> list[int]:
        return [r.type.rank for r in self.grid.results[3:]]


def read_tiled_backward(grid: Op) -> TiledBackward:
    body = grid.regions[0]
    loops = [op for op in body.ops if op.name == "ac.tile_for"]
    if len(loops) != 1:
        raise LoweringError("an ac.key_grid must hold exactly one query loop")
    loop = loops[0]
    before = body.ops[: body.ops.index(loop)]
    prologue = [op for op in before if op.results and op.results[0].type.rank == 0]
    loop_body = loop.regions[0]
    switches = [op for op in loop_body.ops if op.name == "ac.switch"]
    if switches:
        switch = switches[0]
        classify = loop_body.ops[: loop_body.ops.index(switch)]
        carried = loop_body.args[1:]
        masked, full = _tile(switch.regions[1], carried), _tile(switch.regions[2], carried)
        tile_class, default = switch.operands[0], 1
    else:
        classify, masked, full, tile_class = [], _tile(loop_body, loop_body.args[1:]), None, None
        default = loop.attrs.get("tile_class", 1)
    qk = producer(masked.score.operands[-1])
    dp = _dp(producer(masked.gradient.operands[-1]))
    k_load = _load_of(producer(qk.operands[1]).operands[0])
    v_load = _load_of(producer(dp.operands[1]).operands[0])
    return TiledBackward(grid, prologue, k_load, v_load, loop, classify, tile_class, default, masked, full)
