"""Reading the tile-level IR that flash-tiling and mask-elimination produce.

Backends lower an ``ac.tile_grid`` as a kernel template whose variable parts
all come from the IR: the scalar prologue (GQA head mapping, loop bounds),
the per-tile classification, the score and mask functions (``ac.map``
regions), which operands feed the loads, and the block sizes.  Index tiles
(``i0 + iota`` clamped to the sequence) become per-element expressions.
"""

from __future__ import annotations

from dataclasses import dataclass

from attncomp.backends.codegen import dim_expr, literal, select_max, select_min
from attncomp.errors import AttncompError
from attncomp.ir.core import Block, Op, Value, producer


class LoweringError(AttncompError):
    """The IR holds something this backend cannot lower."""


@dataclass
class TileCompute:
    """One variant of the key-tile computation (masked or full)."""

    block: Block
    scalar_ops: list[Op]
    k_load: Op
    v_load: Op
    score: Op
    mask: Op | None  # None: every key in bounds is visible
    #: the probabilities' weight (dropout's), multiplied in after their row sums; None: no weight
    weight: Op | None = None


@dataclass
class TiledAttention:
    grid: Op
    prologue: list[Op]
    q_load: Op
    loop: Op
    classify_ops: list[Op]
    tile_class: Value | None
    default_class: int
    masked: TileCompute
    full: TileCompute | None

    @property
    def block_q(self) -> int:
        return self.grid.attrs["block_q"]

    @property
    def block_k(self) -> int:
        return self.loop.attrs["block_k"]

    @property
    def batch_args(self) -> list[Value]:
        return self.grid.regions[0].args[:-1]

    @property
    def i0(self) -> Value:
        return self.grid.regions[0].args[-1]

    @property
    def with_lse(self) -> bool:
        return len(self.grid.results) - self.with_max == 2

    @property
    def with_max(self) -> bool:
        """Whether the grid also returns each row's max score, as its last result."""
        return bool(self.grid.attrs.get("with_max", False))

    def row_stores(self, index: str) -> dict:
        """What a kernel's finish and merge (``lse_merge``) take from the grid, its outputs ``out_0``,
        ``out_1``, ...: where a row's log-sum-exp and max score go (``index``: the row's; None for those
        the grid does not return): ``lse`` and ``top``; and whether the output is normalised."""
        last = len(self.grid.results) - 1
        return {
            "lse": f"out_1[{index}]" if self.with_lse else None,
            "top": f"out_{last}[{index}]" if self.with_max else None,
            "normalized": self.normalized,
        }

    @property
    def normalized(self) -> bool:
        """Whether the output is ``acc / l`` (softmax); False: ``acc exp(m)`` (sigmoid attention)."""
        return bool(self.grid.attrs.get("normalized", True))

    @property
    def score_bound(self) -> float | None:
        """A bound no score exceeds (``ac.tile_grid``'s ``score_bound``), which a kernel may keep as every
        row's max, never rescaling; None where there is none or the grid returns each row's exact max."""
        return None if self.with_max else self.grid.attrs.get("score_bound")

    @property
    def weighted(self) -> bool:
        """Whether the probabilities carry a weight region (attention dropout)."""
        return self.masked.weight is not None

    @property
    def rows(self) -> Value:
        return self.masked.score.operands[-3]

    @property
    def cols(self) -> Value:
        return self.masked.score.operands[-2]


def _compute(block: Block) -> TileCompute:
    loads = [op for op in block.ops if op.name == "ac.tile_load"]
    maps = {op.attrs.get("role"): op for op in block.ops if op.name == "ac.map"}
    transposed = {op.operands[0] for op in block.ops if op.name == "ac.transpose"}
    k_loads = [op for op in loads if _through_cast(op.results[0], block) & transposed]
    if len(loads) != 2 or len(k_loads) != 1 or "score" not in maps:
        raise LoweringError("unrecognised key-tile computation (expected the flash-tiling structure)")
    v_load = next(op for op in loads if op is not k_loads[0])
    scalar_ops = [op for op in block.ops if op.results and op.results[0].type.rank == 0]
    return TileCompute(block, scalar_ops, k_loads[0], v_load, maps["score"], maps.get("mask"), maps.get("weight"))


def _through_cast(value: Value, block: Block) -> set[Value]:
    """``value`` and the result of a cast of it, if any."""
    found = {value}
    for op in block.ops:
        if op.name == "ac.cast" and op.operands[0] is value:
            found.add(op.results[0])
    return found


def read_tiled_attention(grid: Op) -> TiledAttention:
    body = grid.regions[0]
    loops = [op for op in body.ops if op.name == "ac.tile_for"]
    if len(loops) != 1:
        raise LoweringError("an ac.tile_grid must hold exactly one key loop")
    loop = loops[0]
    before = body.ops[: body.ops.index(loop)]
    prologue = [op for op in before if op.results and op.results[0].type.rank == 0]
    q_loads = [op for op in before if op.name == "ac.tile_load"]
    if len(q_loads) != 1:
        raise LoweringError("an ac.tile_grid must load one query tile")
    loop_body = loop.regions[0]
    switches = [op for op in loop_body.ops if op.name == "ac.switch"]
    if switches:
        switch = switches[0]
        classify = loop_body.ops[: loop_body.ops.index(switch)]
        masked, full = _compute(switch.regions[1]), _compute(switch.regions[2])
        return TiledAttention(grid, prologue, q_loads[0], loop, classify, switch.operands[0], 1, masked, full)
    compute = _compute(loop_body)
    default = loop.attrs.get("tile_class", 1)
    return TiledAttention(grid, prologue, q_loads[0], loop, [], None, default, compute, None)


def element_expr(
    value: Value, names: dict[Value, str], row: str, col: str, select: str | None = None, clamped: bool = True
) -> str:
    """An index tile's element ``[row, col]`` as a scalar expression (``select``: the generated code's
    branch-free choice for ``minimum`` and ``maximum``, as ``codegen.choose`` takes it).  ``clamped=False``
    leaves out the clamp of a tile's positions to the last (``tile_building.positions``), for code that
    computes the elements of valid rows and keys alone: there the clamp changes nothing, and without it
    a position is the loop's index plus the tile's start, whose reads LLVM sees are consecutive."""
    if value in names:
        return names[value]
    op = producer(value)
    if op is None:
        raise LoweringError(f"no element expression for block argument {value}")
    if not clamped and is_position_clamp(op):
        return element_expr(op.operands[0], names, row, col, select, clamped)
    sub = [element_expr(v, names, row, col, select, clamped) for v in op.operands]
    if op.name == "ac.iota":
        return row if op.attrs["axis"] == 0 else col
    if op.name == "ac.constant":
        return literal(op.attrs["value"], value.type.dtype)
    if op.name == "ac.dim":
        return dim_expr(op.attrs["value"])
    binary = {"ac.add": "+", "ac.sub": "-", "ac.mul": "*", "ac.floordiv": "//", "ac.mod": "%"}
    if op.name in binary:
        return f"({sub[0]} {binary[op.name]} {sub[1]})"
    if op.name in ("ac.minimum", "ac.maximum"):
        return (select_min if op.name == "ac.minimum" else select_max)(sub[0], sub[1], select)
    raise LoweringError(f"cannot lower {op.name} on an index tile")


def is_position_clamp(op: Op) -> bool:
    """Whether ``op`` is ``minimum(start + iota, length - 1)``: a tile's positions clamped to the last
    (``tile_building.positions``), which changes only the positions of lanes past the last."""
    if op.name != "ac.minimum":
        return False
    raw, bound = (producer(v) for v in op.operands)
    if raw is None or bound is None or raw.name != "ac.add" or bound.name != "ac.dim":
        return False
    return any((p := producer(v)) is not None and p.name == "ac.iota" for v in raw.operands)
