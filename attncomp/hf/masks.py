"""The mask function registered with ``AttentionMaskInterface``: compact facts, never a mask.

transformers builds a model's masks once per forward (``create_causal_mask``,
``create_sliding_window_causal_mask``, ``create_bidirectional_mask``) and calls the mask
function registered under the model's ``attn_implementation`` with the sizes, the offsets a
cache gives, the 2D ``attention_mask`` and a ``mask_function(b, h, q, kv)`` that describes the
pattern. ``sdpa`` expands that into a ``[B, 1, T, S]`` boolean tensor; :func:`attncomp_mask`
returns :class:`MaskFacts` instead, whose tensors hold O(B * (T + S)) integers, and the
attention turns them into the default spec's captured tensors.

How each pattern is read, without ever evaluating the mask on T x S pairs:

- causal or not: the bidirectional mask builders (``config.is_causal = False`` models, encoders)
  pass ``allow_is_bidirectional_skip``, the causal ones do not (:func:`_bidirectional`).
- the sliding window: the ``local_size`` the sliding-window mask passes, which is
  ``config.sliding_window``. A causal window shows ``local_size`` keys, the query's own
  included; a bidirectional one (ModernBERT's local layers, T5Gemma's encoder)
  the keys at most ``local_size`` positions away on either side, which the facts give as the
  window ``local_size + 1`` (a key shown when ``|i - j| < window``), checked against the mask
  function itself on one row before it is used (:func:`_check_two_sided`).
- chunked attention (Llama 4's ``attention_chunk_size``, the ``local_size`` the chunked mask
  passes): a query sees the keys of its own chunk, causally; each chunk becomes a segment, its id
  ``(position - left padding) // chunk`` at absolute positions (:func:`_chunks`), so the
  segments' spec computes it, over a cache and padding alike.
- a cache: ``q_offset`` and ``kv_offset`` give ``shift = q_offset - kv_offset``.
- padding: the 2D ``attention_mask`` (left or right), sliced to the keys the layer holds;
  padded keys get segment id -1.
- bidirectional blocks (``block_sequence_ids``: an image's tokens see each other, Gemma 3,
  PaliGemma), which transformers ORs into a causal mask function: read back from the function on
  the diagonal above the main one (may key ``j`` see key ``j + 1``?), O(B * S) evaluations; each
  run of keys seeing the next is a block (:func:`_blocks`), for ``hf_attention_blocks``.
- packed sequences: transformers finds them only with no ``attention_mask`` and no cache, where
  queries and keys are the same tokens. Then the mask function is evaluated once per token on
  the diagonal below the main one (may token ``t`` see token ``t - 1``?): a ``False`` starts a
  new sequence. That is O(B * T) evaluations of an index-based function, which also works
  under ``torch.compile``.
- custom ``or_mask_function`` / ``and_mask_function`` overlays (Gemma 3's sliding layers with an
  image; any function a user passes): transformers evaluates those pair by pair, and so does
  :func:`attncomp_mask`, through transformers' own ``sdpa_mask``: ``MaskFacts.dense`` holds the
  ``[B, 1, T, S]`` boolean mask, the one ``sdpa`` gets, attended by ``hf_attention_mask``.
  A 4D mask the caller passes to the model reaches the attention as it is, and is attended the
  same way (:mod:`attncomp.hf.attention`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from transformers import masking_utils


class MaskFacts(NamedTuple):
    """What one mask of a forward pass says, in O(B * (T + S)) integers.

    ``shift[b]``: query ``i`` sits at key position ``i + shift[b]`` (int32, ``[B]``).
    ``q_doc`` (``[B, T]``) and ``k_doc`` (``[B, S]``): segment ids, or None where every query
    sees every key its causality and window allow (no padding, one sequence per row).
    ``window``: the sliding window (None: full attention): a causal query sees ``window`` keys, itself
    included; a bidirectional one the keys less than ``window`` positions away on either side.
    ``causal``: False for bidirectional masks.  A query sees a key when causality and the window allow it or the two
    share a block, and only then if the two share a segment (where there are segments).
    """

    shift: torch.Tensor
    q_doc: torch.Tensor | None
    k_doc: torch.Tensor | None
    window: int | None
    causal: bool
    #: bidirectional blocks (``q_blk[b, i]``, ``k_blk[b, j]``, ``[B, T]`` and ``[B, S]``): a query
    #: also sees every key of its own block (id >= 0), earlier or later; None where there are none
    q_blk: torch.Tensor | None = None
    k_blk: torch.Tensor | None = None
    #: a mask as data, the whole of it (shift, segments, window and blocks are not read): a custom
    #: overlay's mask evaluated pair by pair, or a 4D mask the caller passed (``[B, 1 or H, T, S]``,
    #: boolean, or float added to the scores); None for masks told by the facts above
    dense: torch.Tensor | None = None

    #: transformers' ``generate`` with a static cache builds each step's masks ahead of the forward and
    #: hands them to the model as its ``attention_mask``; the model's mask builders then ask it for
    #: ``ndim`` (a 2D mask is read as padding) and pass any other on to the mask function, which gives
    #: facts back as they are (:func:`attncomp_mask`)
    ndim = 4


def attncomp_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: Any = 0,
    kv_offset: int = 0,
    mask_function: Any = None,
    attention_mask: torch.Tensor | None = None,
    local_size: int | None = None,
    use_vmap: bool = False,
    device: Any = "cpu",
    config: Any = None,
    block_sequence_ids: Any = None,
    **kwargs: Any,
) -> MaskFacts:
    """The mask function for ``AttentionMaskInterface``: the facts of the mask, not the mask.  Facts
    given as ``attention_mask`` (built ahead for this step by ``generate``) are the answer as they are."""
    if isinstance(attention_mask, MaskFacts):
        return attention_mask
    causal = not _bidirectional(mask_function, kwargs)
    if use_vmap:  # a custom overlay, which only evaluating it pair by pair can read
        dense = masking_utils.sdpa_mask(
            batch_size=batch_size,
            q_length=q_length,
            kv_length=kv_length,
            q_offset=q_offset,
            kv_offset=kv_offset,
            mask_function=mask_function,
            attention_mask=attention_mask,
            local_size=local_size,
            allow_is_causal_skip=False,
            use_vmap=True,
            device=device,
        )
        return MaskFacts(_shift(q_offset, kv_offset, batch_size, device), None, None, None, causal, dense=dense)
    window = chunk = None
    if local_size is not None:
        if config is not None and local_size == getattr(config, "attention_chunk_size", None):
            chunk = int(local_size)  # chunked attention (Llama 4): each chunk a segment
        elif config is not None and local_size != getattr(config, "sliding_window", None):
            raise NotImplementedError(
                f"attncomp.hf: a mask with local_size={local_size} that is neither the config's sliding_window "
                "nor its attention_chunk_size is not supported by the default spec"
            )
        else:
            window = int(local_size)
            if not causal:
                window = _check_two_sided(mask_function, window, kv_offset, device) + 1
    shift = _shift(q_offset, kv_offset, batch_size, device)
    q_doc = k_doc = None
    keys = None
    if attention_mask is not None:
        keys = attention_mask[:, kv_offset : kv_offset + kv_length].to(device=device, dtype=torch.bool)
        if keys.shape[-1] < kv_length:  # a mask shorter than the keys (a static cache): the rest is not visible
            keys = torch.nn.functional.pad(keys, (0, kv_length - keys.shape[-1]))
    if chunk is not None:
        q_doc, k_doc = _chunks(chunk, shift, kv_offset, q_length, kv_length, attention_mask, device)
        if keys is not None:
            k_doc = torch.where(keys, k_doc, -1)
    elif keys is not None:
        k_doc = torch.where(keys, 0, -1).to(torch.int32)
        q_doc = torch.zeros(batch_size, q_length, dtype=torch.int32, device=device)
    elif causal and _may_be_packed(mask_function, q_length, kv_length, q_offset, kv_offset):
        q_doc = _documents(mask_function, batch_size, q_length, device)
        if q_doc is not None:
            k_doc = q_doc
    q_blk = k_blk = None
    if causal and not _plain(mask_function):
        q_blk, k_blk = _blocks(mask_function, shift, kv_offset, q_length, kv_length, device)
    return MaskFacts(shift, q_doc, k_doc, window, causal, q_blk, k_blk)


def _shift(q_offset: Any, kv_offset: int, batch_size: int, device: Any) -> torch.Tensor:
    """``q_offset - kv_offset`` for every batch row (``q_offset`` is a tensor under a static cache)."""
    if isinstance(q_offset, torch.Tensor):
        return (q_offset.reshape(-1)[:1] - kv_offset).to(device=device, dtype=torch.int32).expand(batch_size)
    return torch.full((batch_size,), int(q_offset) - int(kv_offset), dtype=torch.int32, device=device)


def _chunks(
    chunk: int,
    shift: torch.Tensor,
    kv_offset: int,
    q_length: int,
    kv_length: int,
    attention_mask: torch.Tensor | None,
    device: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked attention's segments: the chunk of each query and key, ``(position - pad[b]) // chunk``
    at their absolute positions (a query's is ``i + shift[b] + kv_offset``, a key's ``j + kv_offset``),
    where ``pad[b]`` is the row's left padding (its 2D mask's leading zeros: a padded row's chunks
    start at its first real token, as transformers' ``chunked_overlay`` has them)."""
    batch = shift.shape[0]
    pad = torch.zeros(batch, dtype=torch.int64, device=device)
    if attention_mask is not None:
        pad = (attention_mask.to(device).cumsum(-1) == 0).sum(-1).to(torch.int64)
    start = kv_offset - pad[:, None]
    queries = torch.arange(q_length, device=device)[None, :] + shift.to(torch.int64)[:, None] + start
    keys = torch.arange(kv_length, device=device)[None, :] + start
    q_doc = torch.div(queries, chunk, rounding_mode="floor").to(torch.int32)
    return q_doc, torch.div(keys, chunk, rounding_mode="floor").to(torch.int32)


def _bidirectional(mask_function: Any, options: dict) -> bool:
    """Whether the mask has no causality: transformers' bidirectional builders
    (``create_bidirectional_mask``, ``create_bidirectional_sliding_window_mask``) pass
    ``allow_is_bidirectional_skip``, the causal ones do not; or the function is
    ``bidirectional_mask_function`` itself. (Not read from the function's closure, which a
    ``torch.compile`` trace cannot open without losing the function's own cells.)"""
    return "allow_is_bidirectional_skip" in options or mask_function is masking_utils.bidirectional_mask_function


def _check_two_sided(mask_function: Any, size: int, kv_offset: int, device: Any) -> int:
    """``size``, once the bidirectional ``mask_function`` is seen to show a query exactly the keys at most
    ``size`` positions away on either side (transformers' ``sliding_window_bidirectional_overlay``): one
    query's row of ``2 * size + 5`` keys evaluated (not under ``torch.compile``, which cannot branch
    on it). Any other pattern is refused rather than attended as another one."""
    if torch.compiler.is_compiling():
        return size
    query = kv_offset + size + 2
    keys = torch.arange(kv_offset, kv_offset + 2 * size + 5, device=device)
    at = torch.tensor(query, device=device)
    shown = torch.as_tensor(mask_function(torch.tensor(0, device=device), 0, at, keys), device=device)
    if not torch.equal(shown.expand(keys.shape), (keys - query).abs() <= size):
        raise NotImplementedError(
            f"attncomp.hf: a bidirectional mask with local_size={size} whose keys are not those at most {size} "
            "positions from the query is not supported by the default spec"
        )
    return size


def _plain(mask_function: Any) -> bool:
    """Whether ``mask_function`` is transformers' causal or bidirectional function itself."""
    plain = (masking_utils.causal_mask_function, masking_utils.bidirectional_mask_function)
    return mask_function is None or any(mask_function is f for f in plain)


def _blocks(
    mask_function: Any, shift: torch.Tensor, kv_offset: int, q_length: int, kv_length: int, device: Any
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Bidirectional blocks in a causal mask (``block_sequence_ids``: an image's tokens see each
    other, ``blockwise_overlay``): read from the mask itself on the diagonal above the main one (may
    key ``j`` see key ``j + 1``, a later one?), O(B * S) evaluations.  A block is a run of keys each
    seeing the next, its id the run's number; a key in no run gets -1, as does a query outside the
    keys.  None, None where no key sees a later one (outside ``torch.compile``)."""
    batch = shift.shape[0]
    rows = torch.arange(batch, device=device)[:, None]
    j = torch.arange(kv_offset, kv_offset + kv_length - 1, device=device)[None, :]
    ahead = torch.as_tensor(mask_function(rows, 0, j, j + 1), device=device).expand(batch, kv_length - 1)
    if not torch.compiler.is_compiling() and not bool(ahead.any()):
        return None, None
    false = torch.zeros(batch, 1, dtype=torch.bool, device=device)
    seen, sees = torch.cat([false, ahead], -1), torch.cat([ahead, false], -1)  # by key j - 1; key j + 1
    run = (sees & ~seen).cumsum(-1) - 1  # a run starts at a key that sees the next and is not seen
    k_blk = torch.where(seen | sees, run, -1).to(torch.int32)
    at = torch.arange(q_length, device=device)[None, :] + shift.to(torch.int64)[:, None]  # each query's key
    inside = (at >= 0) & (at < kv_length)
    q_blk = torch.where(inside, k_blk.gather(1, at.clamp(0, kv_length - 1)), -1).to(torch.int32)
    return q_blk, k_blk


def _may_be_packed(mask_function: Any, q_length: int, kv_length: int, q_offset: Any, kv_offset: int) -> bool:
    """Whether transformers may have wrapped ``mask_function`` for packed sequences: it does so only
    for self-attention with no cache and no 2D mask; a plain causal or bidirectional mask it
    passes as the function itself."""
    if _plain(mask_function):
        return False
    return q_length == kv_length and isinstance(q_offset, int) and q_offset == 0 and kv_offset == 0


def _documents(mask_function: Any, batch_size: int, length: int, device: Any) -> torch.Tensor | None:
    """Sequence ids from the mask itself: token ``t`` starts a sequence when it cannot see ``t - 1``.

    None when every row holds one sequence (outside ``torch.compile``, which cannot branch on it).
    """
    rows = torch.arange(batch_size, device=device)[:, None]
    t = torch.arange(1, length, device=device)[None, :]
    sees_previous = torch.as_tensor(mask_function(rows, 0, t, t - 1), device=device).expand(batch_size, length - 1)
    starts = torch.cat([torch.zeros(batch_size, 1, dtype=torch.int32, device=device), (~sees_previous).int()], -1)
    documents = starts.cumsum(-1, dtype=torch.int32)
    if not torch.compiler.is_compiling() and not bool(documents[:, -1].any()):
        return None
    return documents
