"""The default specs: what a Hugging Face model's ``sdpa`` or ``eager`` attention computes.

Every spec takes query, key and value as the model hands them (``[B, H, T, D]`` queries,
``[B, KV, S, D]`` keys and values: grouped-query and multi-query attention read the shared
heads through ``ac.repeat_kv``, never copied), and the mask's facts as small captured tensors
(see :mod:`attncomp.hf.masks`):

- ``shift[b]``: query ``i`` sits at key position ``i + shift[b]``. Causal attention shows key
  ``j`` when ``j <= i + shift[b]``: with a cache of ``P`` earlier tokens ``shift = P``, the
  bottom-right aligned causal mask.
- ``q_doc[b, i]``, ``k_doc[b, j]``: segment ids. A query sees a key of its own segment only:
  padded keys have ``k_doc = -1``, and packed sequences one id per sequence.

The compile-time constants are the layer's: ``scale`` (the model's ``scaling``; None, the default,
where it is ``D ** -0.5``, which the spec then reads from the sizes: under ``torch.compile`` with
dynamic sizes no size becomes a constant of the trace), ``window``
(its sliding window, 0 for none: a causal query sees ``window`` keys, itself included, as HF's
``sliding_window_overlay``; a bidirectional one the keys less than ``window`` positions away on
either side, ``sliding_window_bidirectional_overlay`` of ``window - 1``), ``softcap`` (Gemma 2's
``cap * tanh(s / cap)``, 0.0 for none) and ``causal`` (False for bidirectional layers).

- ``position_bias[h, i, j]``: a model's bias per head added to the scores, one for the whole
  batch, T5's learned relative positions (``hf_attention_position_bias``; ``[B, H, T, S]``, one a
  batch row: ``hf_attention_position_bias_rows``).
- ``q_blk[b, i]``, ``k_blk[b, j]``: bidirectional blocks in a causal mask (an image's tokens,
  transformers' ``block_sequence_ids``): a query also sees every key of its own block (id >= 0),
  later ones included (``hf_attention_blocks``).

- ``mask[b, i, j]`` (``[B, T, S]``) or ``mask[b, h, i, j]`` (``[B, H, T, S]``): a mask as data,
  the whole of it: a 4D mask the caller passed to the model (boolean, or added to the scores as
  SDPA adds a float mask), or a custom overlay's mask function evaluated pair by pair
  (``hf_attention_mask*``, ``hf_attention_bias*``). Mask-elimination classifies each tile from the
  mask's minimum and maximum over it, so tiles it hides are skipped and tiles it shows whole
  computed without reading it.

Attention dropout (a model in training mode with an attention dropout rate): each spec's
:func:`with_dropout` variant takes a ``seed`` after its arguments and the rate as the constant
``dropout``, and drops out the probabilities with ``ac.dropout``.

The ``*_sinks`` specs add gpt-oss's attention sinks: one learned logit per head that joins
each row's softmax denominator and gives no value,
``out * exp(lse) / (exp(lse) + exp(sinks[h]))``, written from the row's log-sum-exp so that
the sinks get their gradient too.
"""

# Dimension names such as ac.f32["B", "T"] are sizes, not forward references.
# ruff: noqa: F821

import inspect
from contextvars import ContextVar
from typing import Any

import attncomp as ac


def masked_scores(
    q: Any,
    k: Any,
    shift: Any,
    q_doc: Any,
    k_doc: Any,
    *,
    scale: float | None,
    window: int,
    softcap: float,
    causal: bool,
    q_blk: Any = None,
    k_blk: Any = None,
    bias: Any = None,
    bias_rows: bool = False,
) -> Any:
    """The scores of the layer: scaled, soft-capped, plus ``bias[h, i, j]`` where given (T5's
    ``position_bias``; ``bias[b, h, i, j]`` with ``bias_rows``), and ``-inf`` where the mask hides a key."""
    n_rep = q.shape[1] // k.shape[1]
    scores = (q @ ac.repeat_kv(k, n_rep).mT) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if softcap:
        scores = softcap * ac.tanh(scores / softcap)
    b, h, i, j = ac.index(scores)
    if bias is not None:
        scores = scores + (bias[b, h, i, j] if bias_rows else bias[h, i, j])
    position = i + shift[b]  # the query's position among the keys
    visible = None
    if causal:
        visible = j <= position
    if window:
        near = position - j < window
        if not causal:  # both sides
            near = near & (j - position < window)
        visible = near if visible is None else visible & near
    if q_blk is not None:  # a block's keys, later ones too
        block = (q_blk[b, i] == k_blk[b, j]) & (q_blk[b, i] >= 0)
        visible = block if visible is None else visible | block
    if q_doc is not None:
        same = q_doc[b, i] == k_doc[b, j]
        visible = same if visible is None else visible & same
    return scores if visible is None else ac.where(visible, scores, -ac.inf)


def dense_scores(
    q: Any, k: Any, mask: Any, *, heads: bool, scale: float | None, softcap: float, floor: Any = None
) -> Any:
    """The layer's scores under a mask given as data: a boolean ``mask`` shows a key where true;
    a float one (``floor`` given) is added to the scores, and a key where it is at most ``floor``
    is hidden (as ``-inf`` would hide it; the type's lowest value, as transformers writes masks)."""
    n_rep = q.shape[1] // k.shape[1]
    scores = (q @ ac.repeat_kv(k, n_rep).mT) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if softcap:
        scores = softcap * ac.tanh(scores / softcap)
    b, h, i, j = ac.index(scores)
    at = mask[b, h, i, j] if heads else mask[b, i, j]
    if floor is None:
        return ac.where(at, scores, -ac.inf)
    return ac.where(at > floor, scores + at, -ac.inf)


def attend(q: Any, k: Any, v: Any, scores: Any) -> Any:
    """``softmax(scores) @ v`` with ``v`` shared by each group of query heads; in a spec made by
    :func:`with_dropout`, the probabilities dropped out (``ac.dropout``) first."""
    p = ac.softmax(scores, axis=-1)
    if (drop := DROPOUT.get()) is not None:
        p = ac.dropout(p, *drop)
    return p @ ac.repeat_kv(v, q.shape[1] // k.shape[1])


#: (rate, seed) while a :func:`with_dropout` spec traces its base spec's body; None otherwise
DROPOUT: ContextVar[tuple[float, Any] | None] = ContextVar("attncomp_hf_dropout", default=None)
#: base spec -> its dropout variant (made on first use: tracing a spec takes a while)
DROPOUT_SPECS: dict[ac.Spec, ac.Spec] = {}


def with_dropout(base: ac.Spec) -> ac.Spec:
    """``base`` (a spec of this module) with attention dropout, as a model in training mode asks:
    its arguments then ``seed: ac.i64`` (a new one each call), its constants and ``dropout`` (the
    rate). Its name is ``base``'s with ``_dropout``; made once per base spec."""
    if base in DROPOUT_SPECS:
        return DROPOUT_SPECS[base]
    signature = inspect.signature(base.fn, eval_str=True)
    params = list(signature.parameters.values())
    positional = [p for p in params if p.kind is not inspect.Parameter.KEYWORD_ONLY]
    keywords = [p for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY]
    seed = inspect.Parameter("seed", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=ac.i64)
    rate = inspect.Parameter("dropout", inspect.Parameter.KEYWORD_ONLY, default=0.0)

    def attention_with_dropout(*args: Any, dropout: float = 0.0, **constants: Any) -> Any:
        *inputs, seed = args
        token = DROPOUT.set((dropout, seed))
        try:
            return base.fn(*inputs, **constants)
        finally:
            DROPOUT.reset(token)

    attention_with_dropout.__signature__ = signature.replace(parameters=[*positional, seed, *keywords, rate])
    attention_with_dropout.__name__ = attention_with_dropout.__qualname__ = f"{base.name}_dropout"
    attention_with_dropout.__doc__ = f"``{base.name}`` with attention dropout of rate ``dropout``, drawn from ``seed``."
    DROPOUT_SPECS[base] = ac.spec(attention_with_dropout)
    return DROPOUT_SPECS[base]


def with_sinks(out: Any, scores: Any, sinks: Any) -> Any:
    """``out`` renormalised as if each row's softmax had one more logit, ``sinks[h]``."""
    lse = ac.logsumexp(scores, axis=-1)
    b, h, i = ac.index(lse)
    # exp(lse) / (exp(lse) + exp(sink)), shifted by the larger so that a row with no visible key
    # (lse = -inf) gives 0 and a zero gradient, never inf / inf
    top = ac.maximum(lse, sinks[h])
    own = ac.exp(lse - top)
    kept = own / (own + ac.exp(sinks[h] - top))
    return out * kept[..., None]


@ac.spec
def hf_attention(
    q: ac.floating["B", "H", "T", "D"],
    k: ac.floating["B", "KV", "S", "D"],
    v: ac.floating["B", "KV", "S", "E"],
    shift: ac.i32["B"],
    *,
    scale: float | None = None,
    window: int = 0,
    softcap: float = 0.0,
    causal: bool = True,
):
    """Causal (or bidirectional) attention with no padding and one sequence per row."""
    scores = masked_scores(q, k, shift, None, None, scale=scale, window=window, softcap=softcap, causal=causal)
    return attend(q, k, v, scores)


@ac.spec
def hf_attention_segments(
    q: ac.floating["B", "H", "T", "D"],
    k: ac.floating["B", "KV", "S", "D"],
    v: ac.floating["B", "KV", "S", "E"],
    shift: ac.i32["B"],
    q_doc: ac.i32["B", "T"],
    k_doc: ac.i32["B", "S"],
    *,
    scale: float | None = None,
    window: int = 0,
    softcap: float = 0.0,
    causal: bool = True,
):
    """``hf_attention`` where a query sees only keys of its own segment: padding, packed sequences."""
    scores = masked_scores(q, k, shift, q_doc, k_doc, scale=scale, window=window, softcap=softcap, causal=causal)
    return attend(q, k, v, scores)


@ac.spec
def hf_attention_sinks(
    q: ac.floating["B", "H", "T", "D"],
    k: ac.floating["B", "KV", "S", "D"],
    v: ac.floating["B", "KV", "S", "E"],
    shift: ac.i32["B"],
    sinks: ac.floating["H"],
    *,
    scale: float | None = None,
    window: int = 0,
    softcap: float = 0.0,
    causal: bool = True,
):
    """``hf_attention`` with a learned sink logit per head (gpt-oss's ``s_aux``)."""
    scores = masked_scores(q, k, shift, None, None, scale=scale, window=window, softcap=softcap, causal=causal)
    return with_sinks(attend(q, k, v, scores), scores, sinks)


@ac.spec
def hf_attention_segments_sinks(
    q: ac.floating["B", "H", "T", "D"],
    k: ac.floating["B", "KV", "S", "D"],
    v: ac.floating["B", "KV", "S", "E"],
    shift: ac.i32["B"],
    q_doc: ac.i32["B", "T"],
    k_doc: ac.i32["B", "S"],
    sinks: ac.floating["H"],
    *,
    scale: float | None = None,
    window: int = 0,
    softcap: float = 0.0,
    causal: bool = True,
):
    """``hf_attention_segments`` with a learned sink logit per head (gpt-oss's ``s_aux``)."""
    scores = masked_scores(q, k, shift, q_doc, k_doc, scale=scale, window=window, softcap=softcap, causal=causal)
    return with_sinks(attend(q, k, v, scores), scores, sinks)


@ac.spec
def hf_attention_blocks(
    q: ac.floating["B", "H", "T", "D"],
    k: ac.floating["B", "KV", "S", "D"],
    v: ac.floating["B", "KV", "S", "E"],
    shift: ac.i32["B"],
    q_doc: ac.i32["B", "T"],
    k_doc: ac.i32["B", "S"],
    q_blk: ac.i32["B", "T"],
    k_blk: ac.i32["B", "S"],
    *,
    scale: float | None = None,
    window: int = 0,
    softcap: float = 0.0,
    causal: bool = True,
):
    """``hf_attention_segments`` where a query also sees every key of its own bidirectional block
    (``q_blk[b, i] == k_blk[b, j] >= 0``: an image's tokens, transformers' ``block_sequence_ids``)."""
    scores = masked_scores(
        q, k, shift, q_doc, k_doc, scale=scale, window=window, softcap=softcap, causal=causal, q_blk=q_blk, k_blk=k_blk
    )
    return attend(q, k, v, scores)


@ac.spec
def hf_attention_position_bias(
    q: ac.floating["B", "H", "T", "D"],
    k: ac.floating["B", "KV", "S", "D"],
    v: ac.floating["B", "KV", "S", "E"],
    shift: ac.i32["B"],
    q_doc: ac.i32["B", "T"],
    k_doc: ac.i32["B", "S"],
    position_bias: ac.floating["H", "T", "S"],
    *,
    scale: float | None = None,
    window: int = 0,
    softcap: float = 0.0,
    causal: bool = True,
):
    """``hf_attention_segments`` with a bias per head added to the scores, one for the whole batch
    (T5's learned relative position bias, ``position_bias``; its gradient flows back to it)."""
    layer = dict(scale=scale, window=window, softcap=softcap, causal=causal)
    return attend(q, k, v, masked_scores(q, k, shift, q_doc, k_doc, bias=position_bias, **layer))


@ac.spec
def hf_attention_position_bias_rows(
    q: ac.floating["B", "H", "T", "D"],
    k: ac.floating["B", "KV", "S", "D"],
    v: ac.floating["B", "KV", "S", "E"],
    shift: ac.i32["B"],
    q_doc: ac.i32["B", "T"],
    k_doc: ac.i32["B", "S"],
    position_bias: ac.floating["B", "H", "T", "S"],
    *,
    scale: float | None = None,
    window: int = 0,
    softcap: float = 0.0,
    causal: bool = True,
):
    """``hf_attention_position_bias`` with a bias for each batch row."""
    layer = dict(scale=scale, window=window, softcap=softcap, causal=causal)
    return attend(q, k, v, masked_scores(q, k, shift, q_doc, k_doc, bias=position_bias, bias_rows=True, **layer))


@ac.spec
def hf_attention_mask(
    q: ac.floating["B", "H", "T", "D"],
    k: ac.floating["B", "KV", "S", "D"],
    v: ac.floating["B", "KV", "S", "E"],
    mask: ac.bool_["B", "T", "S"],
    *,
    scale: float | None = None,
    softcap: float = 0.0,
):
    """Attention under a boolean mask shared by the heads: a query sees key ``j`` where ``mask[b, i, j]``."""
    return attend(q, k, v, dense_scores(q, k, mask, heads=False, scale=scale, softcap=softcap))


@ac.spec
def hf_attention_mask_heads(
    q: ac.floating["B", "H", "T", "D"],
    k: ac.floating["B", "KV", "S", "D"],
    v: ac.floating["B", "KV", "S", "E"],
    mask: ac.bool_["B", "H", "T", "S"],
    *,
    scale: float | None = None,
    softcap: float = 0.0,
):
    """``hf_attention_mask`` with a mask per head."""
    return attend(q, k, v, dense_scores(q, k, mask, heads=True, scale=scale, softcap=softcap))


@ac.spec
def hf_attention_bias(
    q: ac.floating["B", "H", "T", "D"],
    k: ac.floating["B", "KV", "S", "D"],
    v: ac.floating["B", "KV", "S", "E"],
    mask: ac.floating["B", "T", "S"],
    *,
    scale: float | None = None,
    softcap: float = 0.0,
    floor: float = -float("inf"),
):
    """Attention under a float mask shared by the heads, added to the scores; at most ``floor`` hides a key."""
    return attend(q, k, v, dense_scores(q, k, mask, heads=False, scale=scale, softcap=softcap, floor=floor))


@ac.spec
def hf_attention_bias_heads(
    q: ac.floating["B", "H", "T", "D"],
    k: ac.floating["B", "KV", "S", "D"],
    v: ac.floating["B", "KV", "S", "E"],
    mask: ac.floating["B", "H", "T", "S"],
    *,
    scale: float | None = None,
    softcap: float = 0.0,
    floor: float = -float("inf"),
):
    """``hf_attention_bias`` with a mask per head."""
    return attend(q, k, v, dense_scores(q, k, mask, heads=True, scale=scale, softcap=softcap, floor=floor))


#: (boolean, one per head) -> the spec for a mask given as data
MASK_SPECS = {
    (True, False): hf_attention_mask,
    (True, True): hf_attention_mask_heads,
    (False, False): hf_attention_bias,
    (False, True): hf_attention_bias_heads,
}

#: (segments, sinks, bidirectional blocks) -> the default spec for them (blocks come with segments;
#: no model is known to have blocks and sinks both, and no default spec takes them)
DEFAULT_SPECS = {
    (False, False, False): hf_attention,
    (True, False, False): hf_attention_segments,
    (False, True, False): hf_attention_sinks,
    (True, True, False): hf_attention_segments_sinks,
    (True, False, True): hf_attention_blocks,
}
