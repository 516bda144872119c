"""PyTorch's FlexAttention, computed by attncomp: the same calls, one import to swap.

    from attncomp.flex import create_block_mask, flex_attention

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    block_mask = create_block_mask(causal, None, None, L, S)
    out = flex_attention(q, k, v, score_mod=alibi, block_mask=block_mask)

A call reads its ``score_mod`` and its block mask's ``mask_mod`` as expressions, by calling each
once on stand-ins (:mod:`attncomp.flex.recording`: nothing is evaluated on positions), and runs the
spec those expressions make (:mod:`attncomp.flex.specs`), compiled once per expression, tensor
types, scale and backend: differentiable (the gradients of ``q``, ``k``, ``v`` and of float tensors
the modifications read, a learned bias), CPU tensors on the ``cpu`` backend, CUDA tensors on
``cuda``.  The mask is never evaluated into a block mask: mask-elimination classifies each tile
from ``mask_mod``'s expression, so :func:`create_block_mask` only keeps the function, and a block
mask from ``torch.nn.attention.flex_attention.create_block_mask`` is read for its ``mask_mod``.

A query that sees no key gets zeros and a log-sum-exp of ``-inf``, as in FlexAttention.  The
modifications may use what :mod:`attncomp.flex.recording` lists (torch's arithmetic, comparisons,
``& | ~``, ``torch.where``, ``exp log tanh sqrt rsqrt sin cos sigmoid abs maximum minimum clamp``,
casts, and captured tensors indexed by positions), and no Python branch on a tensor.  A Python
number a modification uses is compiled in: a value that changes between calls (a decoding step's
position) belongs in a tensor, read at each call.  Under ``torch.compile(fullgraph=True)`` the
modifications are recorded and the spec compiled at trace time, with no graph break.  It needs the
``torch`` extra; ``import attncomp`` does not import this module (nor torch).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.nn.attention.flex_attention import and_masks, create_mask, noop_mask, or_masks

import attncomp as ac
from attncomp.flex import blocks, listed
from attncomp.flex.recording import record
from attncomp.flex.specs import TYPES, build
from attncomp.torch.traced_ops import TracedOps, trace_constant

#: torch's own mask helpers are here too (``and_masks``, ``or_masks``, ``noop_mask``, ``create_mask``), so
#: that code written for FlexAttention swaps one import
__all__ = ["BlockMask", "and_masks", "create_block_mask", "create_mask", "flex_attention", "noop_mask", "or_masks"]


class BlockMask:
    """What :func:`flex_attention` needs of a block mask: its ``mask_mod`` and the sequence lengths
    it was made for (``(Q_LEN, KV_LEN)``); nothing is evaluated for a call.  FlexAttention's
    ``shape``, ``sparsity()``, ``to_dense()`` and ``to_string()`` evaluate ``mask_mod`` when asked
    (:mod:`attncomp.flex.blocks`), at the batch, heads, ``BLOCK_SIZE`` and device it was made with.

    Indexed as FlexAttention's (``mask[b]``, ``mask[b, h]``, ``mask[0:2, 1:3]``, ``mask[:, :, blocks]``:
    an int keeps its axis, of length 1), it gives the block mask of the batch entries and heads
    picked: its ``mask_mod`` reads the picked ones (``mask_mod(start + step * b, ...)``, or an index
    tensor's entry), so it is one :func:`flex_attention` takes for a batch or heads of that size.
    One with its query blocks picked (``q_blocks``) is for inspection only, as FlexAttention's."""

    __slots__ = ("B", "BLOCK_SIZE", "H", "device", "mask_mod", "q_blocks", "seq_lengths")

    def __init__(
        self,
        mask_mod: Callable,
        seq_lengths: tuple[int, int],
        B: int | None = None,
        H: int | None = None,
        BLOCK_SIZE: tuple[int, int] = (128, 128),
        device: Any = None,
        q_blocks: torch.Tensor | None = None,
    ) -> None:
        self.mask_mod = mask_mod
        self.seq_lengths = seq_lengths
        self.B, self.H, self.BLOCK_SIZE, self.device = B, H, BLOCK_SIZE, device
        #: the query blocks kept by indexing (int64 block numbers), None for all
        self.q_blocks = q_blocks

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """``(B, H, Q_LEN, KV_LEN)``, 1 for a batch or heads of None (the mask is the same for each)."""
        return (self.B or 1, self.H or 1, *self.seq_lengths)

    def numel(self) -> int:
        """The scores the mask covers, ``B * H * Q_LEN * KV_LEN`` (of :attr:`shape`)."""
        return math.prod(self.shape)

    def to_dense(self) -> torch.Tensor:
        """int32 ``[B, H, query blocks, key blocks]``: 1 where a block has a shown entry (one
        FlexAttention computes), 0 where it has none."""
        return self._blocks().to(torch.int32)

    def sparsity(self) -> float:
        """The percentage of the scores in blocks with nothing shown, each other block counted whole
        (FlexAttention's definition: negative where blocks run past the lengths)."""
        return blocks.sparsity(self._blocks(), self.BLOCK_SIZE, *self.seq_lengths)

    def to_string(self, grid_size: int | tuple[int, int] = (20, 20), limit: int = 4) -> str:
        """The computed blocks drawn per (batch, head), as FlexAttention's ``to_string``."""
        return blocks.picture(self._blocks(), grid_size, limit)

    def _adjust(self, new_q_len: int, new_kv_len: int) -> BlockMask:
        """The mask cropped to ``new_q_len`` queries and ``new_kv_len`` keys (its upper left corner, the
        positions kept where they are), as FlexAttention's ``_adjust``."""
        q_blocks = self.q_blocks
        if q_blocks is not None:  # the query blocks picked that the shorter length still has
            q_blocks = q_blocks[q_blocks < -(-int(new_q_len) // self.BLOCK_SIZE[0])]
        lengths = (int(new_q_len), int(new_kv_len))
        return BlockMask(self.mask_mod, lengths, self.B, self.H, self.BLOCK_SIZE, self.device, q_blocks)

    def to(self, device: Any) -> BlockMask:
        """The block mask evaluated on ``device`` when asked (nothing is held to move)."""
        return BlockMask(self.mask_mod, self.seq_lengths, self.B, self.H, self.BLOCK_SIZE, device, self.q_blocks)

    @classmethod
    def from_kv_blocks(
        cls,
        kv_num_blocks: torch.Tensor,
        kv_indices: torch.Tensor,
        full_kv_num_blocks: torch.Tensor | None = None,
        full_kv_indices: torch.Tensor | None = None,
        BLOCK_SIZE: int | tuple[int, int] = 128,
        mask_mod: Callable | None = None,
        seq_lengths: tuple[int, int] | None = None,
        compute_q_blocks: bool = True,
        **options: Any,
    ) -> BlockMask:
        """FlexAttention's block mask from lists of blocks (``compute_q_blocks`` and the backward's
        orderings accepted and unused): the blocks listed per (batch, head, query block), ``mask_mod``
        deciding the entries of the partial ones (``None``: shown whole), the full ones shown whole,
        the others hidden (:mod:`attncomp.flex.listed`).  ``seq_lengths`` defaults to the lists' blocks
        times ``BLOCK_SIZE``."""
        if (full_kv_num_blocks is None) != (full_kv_indices is None):
            raise ValueError("from_kv_blocks: give full_kv_num_blocks and full_kv_indices together, or neither")
        size = (BLOCK_SIZE, BLOCK_SIZE) if isinstance(BLOCK_SIZE, int) else tuple(BLOCK_SIZE)
        if seq_lengths is None:
            seq_lengths = (kv_indices.shape[-2] * size[0], kv_indices.shape[-1] * size[1])
        lengths = (int(seq_lengths[0]), int(seq_lengths[1]))
        kv_blocks = -(-lengths[1] // size[1])
        codes = listed.block_codes(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, kv_blocks)
        function = listed.listed_mask_mod(codes, size, None if mask_mod is None or mask_mod is noop_mask else mask_mod)
        batch, heads = (None if n == 1 else int(n) for n in codes.shape[:2])
        return cls(function, lengths, batch, heads, size, kv_indices.device)

    def __getitem__(self, index: Any) -> BlockMask:
        """The block mask of the batch entries, heads (and query blocks) ``index`` picks."""
        index = index if isinstance(index, tuple) else (index,)
        if len(index) > 3:
            raise IndexError(f"BlockMask: index the batch, heads and query blocks (three at most); got {index!r}")
        batch, heads, rows = (*index, slice(None), slice(None), slice(None))[:3]
        b_pick, h_pick = blocks.pick(batch, self.B or 1, "batch"), blocks.pick(heads, self.H or 1, "heads")
        mask_mod = self.mask_mod
        if (b_pick, h_pick) != (range(self.B or 1), range(self.H or 1)):
            mask_mod = blocks.remapped(mask_mod, b_pick, h_pick)
        q_blocks = self.q_blocks
        if not (isinstance(rows, slice) and rows == slice(None)):
            kept = torch.arange(-(-self.seq_lengths[0] // self.BLOCK_SIZE[0])) if q_blocks is None else q_blocks
            q_blocks = kept[blocks.positions(blocks.pick(rows, len(kept), "query blocks"))]
        b_size, h_size = len(b_pick), len(h_pick)
        return BlockMask(
            mask_mod,
            self.seq_lengths,
            None if self.B is None and b_size == 1 else b_size,
            None if self.H is None and h_size == 1 else h_size,
            self.BLOCK_SIZE,
            self.device,
            q_blocks,
        )

    def __repr__(self) -> str:
        name = getattr(self.mask_mod, "__name__", self.mask_mod)
        return f"BlockMask(shape={self.shape}, BLOCK_SIZE={self.BLOCK_SIZE}, mask_mod={name})"

    def __str__(self) -> str:
        return f"BlockMask(shape={self.shape}, sparsity={self.sparsity():.2f}%, \n{self.to_string().strip()}\n)"

    def _blocks(self) -> torch.Tensor:
        device = "cpu" if self.device is None else self.device
        return blocks.visible_blocks(self.mask_mod, *self.shape, self.BLOCK_SIZE, device, self.q_blocks)


def create_block_mask(
    mask_mod: Callable,
    B: int | None,
    H: int | None,
    Q_LEN: int,
    KV_LEN: int,
    device: Any = None,
    BLOCK_SIZE: int | tuple[int, int] = 128,
    **options: Any,
) -> BlockMask:
    """``torch.nn.attention.flex_attention.create_block_mask``'s arguments (``_compile`` and the like
    accepted and unused): the mask function, kept with the sizes. attncomp's kernels find their
    tiles from the function's expression, so nothing is evaluated here, whatever the lengths."""
    if not callable(mask_mod):
        raise TypeError(f"create_block_mask: mask_mod must be a function (b, h, q_idx, kv_idx), got {mask_mod!r}")
    size = (BLOCK_SIZE, BLOCK_SIZE) if isinstance(BLOCK_SIZE, int) else tuple(BLOCK_SIZE)
    if len(size) != 2 or any(not isinstance(n, int) or n < 1 for n in size):
        raise ValueError(f"create_block_mask: BLOCK_SIZE must be a positive int or two of them; got {BLOCK_SIZE!r}")
    batch, heads = (None if n is None else int(n) for n in (B, H))
    return BlockMask(mask_mod, (int(Q_LEN), int(KV_LEN)), batch, heads, size, device)


class Compiled(NamedTuple):
    """A compiled call: the compiled function (``fn.dump()``, ``fn.ir(stage)``) and its torch op."""

    fn: ac.CompiledFunction
    op: Any


#: each compiled spec, by the name :func:`compile_key` gives
COMPILED = TracedOps()


def compile_key(
    score: tuple | None,
    mask: tuple | None,
    types: tuple,
    dtype: str,
    aux: tuple[bool, bool],
    scale: float | None,
    backend: str,
) -> str:
    """Compile the spec of these expressions, captured types and constants once; give its name in
    ``COMPILED``. Under ``torch.compile`` it runs at trace time, not in the graph
    (``assume_constant_result``): compiling never breaks the graph. ``dtype``: the query's type."""

    def make() -> Compiled:
        constants = {} if scale is None else {"scale": scale}  # None: the spec's E ** -0.5, a size it reads
        fn = ac.compile(build(score, mask, types, *aux), backend=backend, **constants)
        return Compiled(fn, fn.to_torch())

    return COMPILED.name(repr((score, mask, types, dtype, aux, scale, backend)), make)


#: ``compile_key`` as torch.compile sees it: a constant of the trace
constant_compile_key = torch.compiler.assume_constant_result(compile_key)


def compiled_for(
    score_mod: Callable | None,
    block_mask: Any,
    query: torch.Tensor,
    scale: float | None,
    aux: tuple[bool, bool],
    backend: str,
) -> tuple[Compiled, list[torch.Tensor]]:
    """The compiled spec of these modifications and the tensors they read, for a call."""
    mask_mod = _mask_mod(block_mask)
    score, mask, captured = record(score_mod if score_mod is not _identity() else None, mask_mod, query.device)
    types = []
    for n, tensor in enumerate(captured):
        name = str(tensor.dtype).removeprefix("torch.")
        if name not in TYPES:
            raise TypeError(
                f"flex_attention: tensor number {n + 1} that the modifications read is {tensor.dtype}; attncomp "
                f"reads {', '.join(TYPES)}"
            )
        if tensor.device != query.device:
            raise ValueError(
                f"flex_attention: a tensor the modifications read is on {tensor.device}, the query on {query.device}"
            )
        types.append((name, tensor.dim()))
    dtype = str(query.dtype)
    return COMPILED[constant_compile_key(score, mask, tuple(types), dtype, aux, scale, backend)], captured


def flex_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    score_mod: Callable | None = None,
    block_mask: Any = None,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    kernel_options: Any = None,
    *,
    return_aux: Any = None,
    backend: str | None = None,
) -> Any:
    """``torch.nn.attention.flex_attention.flex_attention``'s arguments and results, computed by attncomp.

    ``query`` ``[B, H, L, E]``, ``key`` ``[B, KV, S, E]``, ``value`` ``[B, KV, S, Ev]`` (``KV`` divides
    ``H`` with ``enable_gqa``); ``score_mod(score, b, h, q_idx, kv_idx)`` modifies each scaled score;
    ``block_mask`` (:func:`create_block_mask`'s, or torch's) hides key ``kv_idx`` from query ``q_idx``
    where its ``mask_mod(b, h, q_idx, kv_idx)`` is False; ``scale`` defaults to ``E ** -0.5``.
    ``return_lse`` (or ``return_aux=AuxRequest(lse=True)``) also gives the float32 log-sum-exp of
    each row's scores; ``return_aux=AuxRequest(max_scores=True)`` each row's largest score (``-inf``
    where it sees no key), a by-product of the fused attention, with no gradient.  ``kernel_options``
    is accepted and unused. ``backend``: "cpu", "cuda" or "interp" (default: the tensors' device's).
    """
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 4:
            raise ValueError(f"flex_attention: {name} must be a 4-dimensional tensor [B, heads, length, head size]")
    (batch, heads, length, size), (kv_batch, kv_heads, keys, kv_size) = query.shape, key.shape
    if (kv_batch, kv_heads, keys) != tuple(value.shape[:3]) or kv_batch != batch or kv_size != size:
        raise ValueError(
            f"flex_attention: query {list(query.shape)}, key {list(key.shape)} and value {list(value.shape)} do not "
            "agree (the same batch; key and value the same heads and length; query and key the same head size)"
        )
    if heads != kv_heads and not (enable_gqa and heads % kv_heads == 0):
        raise ValueError(
            f"flex_attention: query has {heads} heads and key {kv_heads}: pass enable_gqa=True, with key heads that "
            "divide the query heads, for grouped-query attention"
        )
    if block_mask is not None:
        if getattr(block_mask, "q_blocks", None) is not None:
            raise ValueError(
                "flex_attention: block_mask was indexed along its query blocks (block_mask[:, :, blocks]), which "
                "is for inspection; index the batch and heads only, or pass the whole block mask"
            )
        lengths = tuple(int(n) for n in getattr(block_mask, "seq_lengths", (length, keys)))
        if lengths != (length, keys):
            raise ValueError(
                f"flex_attention: block_mask was made for {lengths[0]} queries and {lengths[1]} keys; the call has "
                f"{length} and {keys} (block_mask._adjust({length}, {keys}) crops it to them)"
            )
    lse = bool(return_lse) or bool(getattr(return_aux, "lse", False))
    max_scores = bool(getattr(return_aux, "max_scores", False))
    scale = None if scale is None else float(trace_constant(scale))  # None: E ** -0.5, read from the sizes
    backend = backend or ("cuda" if query.device.type == "cuda" else "cpu")
    compiled, captured = compiled_for(score_mod, block_mask, query, scale, (lse, max_scores), backend)
    result = compiled.op(query, key, value, *captured)
    if not (lse or max_scores):
        return result
    out, *rows = result
    log_sum_exp = rows.pop(0).float() if lse else None
    top = rows.pop(0).float() if max_scores else None
    if return_aux is not None:
        from torch.nn.attention.flex_attention import AuxOutput

        return out, AuxOutput(lse=log_sum_exp, max_scores=top)
    return out, log_sum_exp


def _mask_mod(block_mask: Any) -> Callable | None:
    """The block mask's function; None for none, or for a mask that hides nothing.  torch's mask
    whose function is ``noop_mask`` is its lists of blocks (``from_kv_blocks`` without a
    ``mask_mod``): their mask, unless every block is full; another function stands for its mask
    (``create_block_mask`` lists what it shows)."""
    if block_mask is None:
        return None
    mask_mod = getattr(block_mask, "mask_mod", None)
    if not callable(mask_mod):
        raise TypeError(
            "flex_attention: block_mask must come from create_block_mask (attncomp.flex's or torch's), with its "
            f"mask_mod; got {type(block_mask).__name__}"
        )
    if mask_mod is not noop_mask:
        return mask_mod
    if isinstance(block_mask, BlockMask) or getattr(block_mask, "kv_num_blocks", None) is None:
        return None
    _, kv_len = (int(n) for n in block_mask.seq_lengths)
    kv_blocks = -(-kv_len // int(block_mask.BLOCK_SIZE[1]))
    lists = (block_mask.kv_num_blocks, block_mask.kv_indices, block_mask.full_kv_num_blocks)
    codes = listed.block_codes(*lists, block_mask.full_kv_indices, kv_blocks)
    if not torch.compiler.is_compiling() and bool((codes != listed.HIDDEN).all()):
        return None  # every block listed, shown whole: no mask (torch's create_block_mask(noop_mask, ...))
    return listed.listed_mask_mod(codes, tuple(int(n) for n in block_mask.BLOCK_SIZE), None)


def _identity() -> Any:
    """torch's score modification that changes nothing (its default), where torch has one."""
    try:
        from torch.nn.attention.flex_attention import _identity as identity
    except ImportError:  # pragma: no cover
        return None
    return identity
