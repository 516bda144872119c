"""Sigmoid attention for PyTorch tensors, computed by attncomp: FlashSigmoid's function in one line.

    from attncomp.sigmoid_attention import sigmoid_attention

    out = sigmoid_attention(q, k, v, is_causal=True)  # sigmoid(q kᵀ / sqrt(E) - log S) @ v

Each key's weight is its own score's logistic function, ``sigmoid(q kᵀ scale + bias)``, not a share
of a softmax over the row, and no row sum divides the result.  ``bias`` defaults to ``-log S`` (the
keys' count), which keeps a row's weights summing to about one at the start of training as
softmax's do.  One spec (below) is compiled once per (causal, window, bias, scale, backend) and its
torch op (``fn.to_torch()``) runs the fused kernels, differentiable, on CPU tensors (``cpu``) and
CUDA tensors (``cuda``).  PyTorch has no fused sigmoid attention: SDPA and FlexAttention normalise
by a softmax.  It needs the ``torch`` extra; ``import attncomp`` does not import this module.
"""

# Dimension names such as ac.floating["B", "T"] are sizes, not forward references.
# ruff: noqa: F821

from typing import Any

import attncomp as ac
from attncomp.torch.head_axes import with_head_axis
from attncomp.torch.traced_ops import TracedOps, trace_constant


@ac.spec
def sigmoid_attention_spec(
    q: ac.floating["B", "H", "L", "E"],
    k: ac.floating["B", "KV", "S", "E"],
    v: ac.floating["B", "KV", "S", "Ev"],
    *,
    scale: float | None = None,
    bias: float | None = None,
    causal: bool = False,
    window: int = 0,
):
    """``sigmoid(q kᵀ scale + bias) @ v`` (``scale`` None: ``E ** -0.5``, ``bias`` None: ``-log S``);
    ``causal`` hides key ``j > i``, ``window`` (0: none) keys ``i - j >= window``; GQA when ``KV``
    divides ``H``."""
    s = q @ ac.repeat_kv(k, q.shape[1] // k.shape[1]).mT
    s = s * (q.shape[-1] ** -0.5 if scale is None else scale) + (-ac.log(k.shape[-2] * 1.0) if bias is None else bias)
    b, h, i, j = ac.index(s)
    p = ac.sigmoid(s)
    if causal:
        p = ac.where(j <= i, p, 0.0)
    if window:
        p = ac.where(i - j < window, p, 0.0)
    return p @ ac.repeat_kv(v, q.shape[1] // k.shape[1])


#: the compiled spec's torch op of each "backend/constants", by the name :func:`op_key` gives
OPS = TracedOps()


def op_key(backend: str, causal: bool, window: int, bias: float | None, scale: float | None) -> str:
    """Compile the spec with these constants on ``backend`` once; give the name of its torch op in ``OPS``."""
    constants = {"causal": causal, "window": window, "bias": bias, "scale": scale}
    constants = {name: value for name, value in constants.items() if value is not None}
    key = f"{backend}/{sorted(constants.items())}"
    return OPS.name(key, lambda: ac.compile(sigmoid_attention_spec, backend=backend, **constants).to_torch())


def sigmoid_attention(
    query: Any,
    key: Any,
    value: Any,
    is_causal: bool = False,
    scale: float | None = None,
    bias: float | None = None,
    window: int | None = None,
    enable_gqa: bool = False,
    *,
    backend: str | None = None,
) -> Any:
    """``sigmoid(query keyᵀ scale + bias) @ value``, fused (nothing of size L x S is built).

    ``query`` ``[..., H, L, E]`` (3 or 4 dims), ``key`` ``[..., KV, S, E]``, ``value`` ``[..., KV, S, Ev]``;
    ``is_causal`` hides key ``j > i``; ``window`` (a positive int) hides keys ``window`` or more
    positions before the query; ``scale`` defaults to ``E ** -0.5``, ``bias`` to ``-log S``;
    ``enable_gqa`` lets ``KV`` divide ``H``.  ``backend``: "cpu", "cuda" or "interp" (default: the
    tensors' device's).
    """
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"sigmoid_attention: window must be a positive int or None, got {window!r}")
    query, key, value, three = with_head_axis("sigmoid_attention", query, key, value, enable_gqa)
    backend = backend or ("cuda" if query.device.type == "cuda" else "cpu")
    scale, bias = trace_constant(scale), trace_constant(bias)
    scale = None if scale is None else float(scale)
    bias = None if bias is None else float(bias)
    out = OPS[op_key(backend, bool(is_causal), window or 0, bias, scale)](query, key, value)
    return out[:, 0] if three else out
