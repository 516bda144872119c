"""PyTorch's ``scaled_dot_product_attention``, computed by attncomp: the same arguments, one line to swap.

    from attncomp.sdpa import scaled_dot_product_attention

    out = scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.1, is_causal=False)

Each call picks one of five specs (below) by what it gets (a mask or none, boolean or float, a
row for every query or one for all), compiles it once per (spec, scale, causal, dropout rate,
backend) and runs its torch op (``fn.to_torch()``): differentiable, CPU tensors on the ``cpu``
backend and CUDA tensors on ``cuda`` (or ``backend=``).  A mask given as data is read where it
broadcasts (``[L, S]``, ``[B or 1, H or 1, L or 1, S]``: never copied to the batch, the heads or
the queries), and mask-elimination classifies its tiles from its per-tile minimum and maximum:
tiles it hides are skipped, tiles it shows whole computed without reading it.  Dropout is
``ac.dropout``, inside the fused kernels, with a new seed each call from torch's CPU generator
(``torch.manual_seed`` repeats a run).

Where PyTorch's semantics have a choice of their own: a query that sees no key gets zeros (PyTorch's
math backend gives NaN); attncomp's dropout mask is its own hash of the positions, not PyTorch's.
It needs the ``torch`` extra; ``import attncomp`` does not import this module (nor torch).
"""

# Dimension names such as ac.floating["B", "T"] are sizes, not forward references.
# ruff: noqa: F821

from typing import Any

import torch

import attncomp as ac
from attncomp.torch.head_axes import with_head_axis
from attncomp.torch.traced_ops import TracedOps, trace_constant


def _scores(q: Any, k: Any, scale: float | None, causal: bool) -> Any:
    """The scaled scores (``scale`` None: ``E ** -0.5``, read from the sizes, so that no size becomes a
    constant of a ``torch.compile`` trace), ``j > i`` hidden where ``causal``."""
    s = (q @ ac.repeat_kv(k, q.shape[1] // k.shape[1]).mT) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if not causal:
        return s
    b, h, i, j = ac.index(s)
    return ac.where(j <= i, s, -ac.inf)


def _mask_at(mask: Any, s: Any, one_row: bool = False) -> Any:
    """``mask`` at each score's place: its batch and head axes broadcast (a size of 1 read at 0), and
    with ``one_row`` its one row read for every query."""
    b, h, i, j = ac.index(s)
    return mask[ac.minimum(b, mask.shape[0] - 1), ac.minimum(h, mask.shape[1] - 1), 0 if one_row else i, j]


def _masked(s: Any, mask: Any, one_row: bool = False) -> Any:
    """The scores with ``mask`` applied where it broadcasts: a boolean hides a key where False, a float
    is added (``-inf`` hides it: tiles it hides are skipped)."""
    at = _mask_at(mask, s, one_row)
    if at.type.dtype == "i1":
        return ac.where(at, s, -ac.inf)
    return ac.where(at > -ac.inf, s + at, -ac.inf)


def _attend(q: Any, k: Any, v: Any, seed: Any, scores: Any, dropout: float) -> Any:
    p = ac.dropout(ac.softmax(scores, axis=-1), dropout, seed)
    return p @ ac.repeat_kv(v, q.shape[1] // k.shape[1])


@ac.spec
def sdpa_attention(
    q: ac.floating["B", "H", "L", "E"],
    k: ac.floating["B", "KV", "S", "E"],
    v: ac.floating["B", "KV", "S", "Ev"],
    seed: ac.i64,
    *,
    scale: float | None = None,
    causal: bool = False,
    dropout: float = 0.0,
):
    """SDPA without a mask (``is_causal``: key ``j`` visible to query ``i`` where ``j <= i``)."""
    return _attend(q, k, v, seed, _scores(q, k, scale, causal), dropout)


@ac.spec
def sdpa_attention_mask(
    q: ac.floating["B", "H", "L", "E"],
    k: ac.floating["B", "KV", "S", "E"],
    v: ac.floating["B", "KV", "S", "Ev"],
    mask: ac.bool_["M", "N", "L", "S"],
    seed: ac.i64,
    *,
    scale: float | None = None,
    dropout: float = 0.0,
):
    """SDPA with a boolean mask (True: the key takes part), ``M`` 1 or ``B``, ``N`` 1 or ``H``."""
    return _attend(q, k, v, seed, _masked(_scores(q, k, scale, False), mask), dropout)


@ac.spec
def sdpa_attention_key_mask(
    q: ac.floating["B", "H", "L", "E"],
    k: ac.floating["B", "KV", "S", "E"],
    v: ac.floating["B", "KV", "S", "Ev"],
    mask: ac.bool_["M", "N", 1, "S"],
    seed: ac.i64,
    *,
    scale: float | None = None,
    dropout: float = 0.0,
):
    """``sdpa_attention_mask`` with one row of the mask for every query (key padding)."""
    return _attend(q, k, v, seed, _masked(_scores(q, k, scale, False), mask, one_row=True), dropout)


@ac.spec
def sdpa_attention_bias(
    q: ac.floating["B", "H", "L", "E"],
    k: ac.floating["B", "KV", "S", "E"],
    v: ac.floating["B", "KV", "S", "Ev"],
    mask: ac.floating["M", "N", "L", "S"],
    seed: ac.i64,
    *,
    scale: float | None = None,
    dropout: float = 0.0,
):
    """SDPA with a float mask added to the scores (``-inf`` hides a key: such tiles are skipped)."""
    return _attend(q, k, v, seed, _masked(_scores(q, k, scale, False), mask), dropout)


@ac.spec
def sdpa_attention_key_bias(
    q: ac.floating["B", "H", "L", "E"],
    k: ac.floating["B", "KV", "S", "E"],
    v: ac.floating["B", "KV", "S", "Ev"],
    mask: ac.floating["M", "N", 1, "S"],
    seed: ac.i64,
    *,
    scale: float | None = None,
    dropout: float = 0.0,
):
    """``sdpa_attention_bias`` with one row of the mask for every query."""
    return _attend(q, k, v, seed, _masked(_scores(q, k, scale, False), mask, one_row=True), dropout)


#: (boolean, one row for every query) -> the spec of a call with a mask
MASK_SPECS = {
    (True, False): sdpa_attention_mask,
    (True, True): sdpa_attention_key_mask,
    (False, False): sdpa_attention_bias,
    (False, True): sdpa_attention_key_bias,
}


#: the compiled spec's torch op of each "spec/backend/constants", by the name :func:`op_key` gives
OPS = TracedOps()
#: the specs by name, for :func:`op_key` (which takes only constants)
SPECS = {spec.name: spec for spec in (sdpa_attention, *MASK_SPECS.values())}


def op_key(spec: str, backend: str, causal: bool | None, dropout: float, scale: float | None) -> str:
    """Compile ``spec`` (a name in ``SPECS``) with these constants (None: the spec's default) on ``backend``
    once; give the name of its torch op in ``OPS``.  Under ``torch.compile`` it runs at trace time, not in
    the graph (``torch.compiler.assume_constant_result``, every argument a constant of the trace: no size
    and no float argument of the call, which a trace with dynamic sizes makes symbolic): compiling never
    breaks the graph."""
    constants = {"causal": causal, "dropout": dropout, "scale": scale}
    constants = {name: value for name, value in constants.items() if value is not None}
    key = f"{spec}/{backend}/{sorted(constants.items())}"
    return OPS.name(key, lambda: ac.compile(SPECS[spec], backend=backend, **constants).to_torch())


#: ``op_key`` as torch.compile sees it: a constant of the trace
constant_op_key = torch.compiler.assume_constant_result(op_key)


def scaled_dot_product_attention(
    query: Any,
    key: Any,
    value: Any,
    attn_mask: Any = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    backend: str | None = None,
) -> Any:
    """``torch.nn.functional.scaled_dot_product_attention``'s arguments and result, computed by attncomp.

    ``query`` ``[..., H, L, E]`` (3 or 4 dims), ``key`` ``[..., KV, S, E]``, ``value`` ``[..., KV, S, Ev]``;
    ``attn_mask`` boolean (True: take part) or float (added), broadcasting to ``[B, H, L, S]``;
    ``is_causal`` (no ``attn_mask`` with it) hides key ``j > i``; ``scale`` defaults to ``E ** -0.5``;
    ``enable_gqa`` lets ``KV`` divide ``H``.  ``backend``: "cpu", "cuda" or "interp" (default: the
    tensors' device's).
    """
    if is_causal and attn_mask is not None:
        raise ValueError("scaled_dot_product_attention: attn_mask and is_causal are exclusive: give one")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"scaled_dot_product_attention: dropout_p must be in [0, 1), got {dropout_p}")
    query, key, value, three = with_head_axis("scaled_dot_product_attention", query, key, value, enable_gqa)
    causal = None  # the constants: causal (the spec without a mask only), dropout and scale (None: E ** -0.5)
    args = [query, key, value]
    if attn_mask is None:
        spec, causal = sdpa_attention, bool(is_causal)
    else:
        mask = attn_mask  # broadcast from the right, as torch does: to [N, L, S] for three dims, then a head axis
        while mask.dim() < (3 if three else 4):
            mask = mask[None]
        if three and mask.dim() == 3:
            mask = mask[:, None]
        full = [query.shape[0], query.shape[1], query.shape[2], key.shape[2]]
        if mask.dim() != 4 or any(m not in (1, n) for m, n in zip(mask.shape, full)):
            raise ValueError(
                f"scaled_dot_product_attention: attn_mask of shape {list(attn_mask.shape)} does not broadcast to {full}"
            )
        keys_only = mask.shape[2] == 1 and full[2] != 1  # one row for every query: read as it is
        spec = MASK_SPECS[(mask.dtype == torch.bool, keys_only)]
        mask = mask if mask.dtype == torch.bool else mask.to(query.dtype)
        args.append(mask.expand(-1, -1, 1 if keys_only else full[2], full[3]))
    seed = (
        torch.randint(-(2**63), 2**63 - 1, (), dtype=torch.int64) if dropout_p else torch.zeros((), dtype=torch.int64)
    )
    backend = backend or ("cuda" if query.device.type == "cuda" else "cpu")
    scale, dropout_p = trace_constant(scale), trace_constant(dropout_p)  # symbols of a trace: their values
    scale = None if scale is None else float(scale)
    dropout = float(dropout_p) if dropout_p else 0.0  # 0.0 a constant even where a trace makes floats symbolic
    out = OPS[constant_op_key(spec.name, backend, causal, dropout, scale)](*args, seed)
    return out[:, 0] if three else out
