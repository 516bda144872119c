"""The specs the benchmarks time."""

# ruff: noqa: F821
import attncomp as ac


@ac.spec
def dense(q: ac.f32["B", "H", "T", "D"], k: ac.f32["B", "H", "S", "D"], v: ac.f32["B", "H", "S", "D"]):
    return ac.softmax((q @ k.mT) * q.shape[-1] ** -0.5, axis=-1) @ v


@ac.spec
def causal(q: ac.f32["B", "H", "T", "D"], k: ac.f32["B", "H", "S", "D"], v: ac.f32["B", "H", "S", "D"]):
    s = (q @ k.mT) * q.shape[-1] ** -0.5
    b, h, i, j = ac.index(s)
    return ac.softmax(ac.where(j <= i, s, -ac.inf), axis=-1) @ v


@ac.spec
def causal_dropout(
    q: ac.floating["B", "H", "T", "D"],
    k: ac.floating["B", "H", "S", "D"],
    v: ac.floating["B", "H", "S", "D"],
    seed: ac.i64,
    *,
    rate: float = 0.1,
):
    """``causal`` with attention dropout (a new ``seed`` each step)."""
    s = (q @ k.mT) * q.shape[-1] ** -0.5
    b, h, i, j = ac.index(s)
    return ac.dropout(ac.softmax(ac.where(j <= i, s, -ac.inf), axis=-1), rate, seed) @ v


@ac.spec
def causal_window(
    q: ac.f32["B", "H", "T", "D"],
    k: ac.f32["B", "H", "S", "D"],
    v: ac.f32["B", "H", "S", "D"],
    *,
    window: int = 256,
):
    s = (q @ k.mT) * q.shape[-1] ** -0.5
    b, h, i, j = ac.index(s)
    return ac.softmax(ac.where((j <= i) & (i - j < window), s, -ac.inf), axis=-1) @ v


@ac.spec
def data_mask(
    q: ac.f32["B", "H", "T", "D"],
    k: ac.f32["B", "H", "S", "D"],
    v: ac.f32["B", "H", "S", "D"],
    m: ac.bool_["B", "T", "S"],
):
    """A mask given as data, as SDPA takes one (a 4D mask a Hugging Face model is handed)."""
    s = (q @ k.mT) * q.shape[-1] ** -0.5
    b, h, i, j = ac.index(s)
    return ac.softmax(ac.where(m[b, i, j], s, -ac.inf), axis=-1) @ v


@ac.spec
def position_bias(
    q: ac.f32["B", "H", "T", "D"],
    k: ac.f32["B", "H", "S", "D"],
    v: ac.f32["B", "H", "S", "D"],
    bias: ac.f32["B", "H", "T", "S"],
):
    """A bias per head added to the scores, unscaled (T5's learned relative positions)."""
    s = q @ k.mT
    b, h, i, j = ac.index(s)
    return ac.softmax(s + bias[b, h, i, j], axis=-1) @ v


@ac.spec
def gqa_decode(q: ac.f32["B", "H", "T", "D"], k: ac.f32["B", "KV", "S", "D"], v: ac.f32["B", "KV", "S", "D"]):
    n_rep = q.shape[1] // k.shape[1]
    s = (q @ ac.repeat_kv(k, n_rep).mT) * q.shape[-1] ** -0.5
    return ac.softmax(s, axis=-1) @ ac.repeat_kv(v, n_rep)


@ac.spec
def causal_any(
    q: ac.floating["B", "H", "T", "D"], k: ac.floating["B", "H", "S", "D"], v: ac.floating["B", "H", "S", "D"]
):
    """``causal`` for every float type: compiled per type the calls bring."""
    s = (q @ k.mT) * q.shape[-1] ** -0.5
    b, h, i, j = ac.index(s)
    return ac.softmax(ac.where(j <= i, s, -ac.inf), axis=-1) @ v


@ac.spec
def causal_sigmoid_any(
    q: ac.floating["B", "H", "T", "D"], k: ac.floating["B", "H", "S", "D"], v: ac.floating["B", "H", "S", "D"]
):
    """Causal sigmoid attention (``examples/sigmoid_attention.py``) for every float type."""
    s = (q @ k.mT) * q.shape[-1] ** -0.5 - ac.log(k.shape[-2] * 1.0)
    b, h, i, j = ac.index(s)
    return ac.where(j <= i, ac.sigmoid(s), 0.0) @ v


@ac.spec
def causal_heads_after_positions_any(
    q: ac.floating["B", "T", "H", "D"], k: ac.floating["B", "S", "H", "D"], v: ac.floating["B", "S", "H", "D"]
):
    """``causal_any`` on FlashAttention's layout (``attncomp.flash_attn``): each tensor read as
    ``[B, H, T, D]`` through a transpose, a view the kernels read in place (a head's rows H * D apart)."""
    q, k, v = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
    s = (q @ k.mT) * q.shape[-1] ** -0.5
    b, h, i, j = ac.index(s)
    return (ac.softmax(ac.where(j <= i, s, -ac.inf), axis=-1) @ v).transpose(0, 2, 1, 3)


@ac.spec
def gqa_decode_any(
    q: ac.floating["B", "H", "T", "D"], k: ac.floating["B", "KV", "S", "D"], v: ac.floating["B", "KV", "S", "D"]
):
    n_rep = q.shape[1] // k.shape[1]
    s = (q @ ac.repeat_kv(k, n_rep).mT) * q.shape[-1] ** -0.5
    return ac.softmax(s, axis=-1) @ ac.repeat_kv(v, n_rep)


@ac.spec
def dense_any(
    q: ac.floating["B", "H", "T", "D"], k: ac.floating["B", "H", "S", "D"], v: ac.floating["B", "H", "S", "D"]
):
    """``dense`` for every float type."""
    return ac.softmax((q @ k.mT) * q.shape[-1] ** -0.5, axis=-1) @ v


@ac.spec
def causal_window_any(
    q: ac.floating["B", "H", "T", "D"],
    k: ac.floating["B", "H", "S", "D"],
    v: ac.floating["B", "H", "S", "D"],
    *,
    window: int = 256,
):
    """``causal_window`` for every float type."""
    s = (q @ k.mT) * q.shape[-1] ** -0.5
    b, h, i, j = ac.index(s)
    return ac.softmax(ac.where((j <= i) & (i - j < window), s, -ac.inf), axis=-1) @ v


@ac.spec
def causal_alibi_any(
    q: ac.floating["B", "H", "T", "D"],
    k: ac.floating["B", "H", "S", "D"],
    v: ac.floating["B", "H", "S", "D"],
    slopes: ac.floating["H"],
):
    """Causal ALiBi for every float type, the slopes in the call's type too."""
    s = (q @ k.mT) * q.shape[-1] ** -0.5
    b, h, i, j = ac.index(s)
    return ac.softmax(ac.where(j <= i, s + slopes[h] * (j - i), -ac.inf), axis=-1) @ v


@ac.spec
def causal_alibi_f32_slopes(
    q: ac.floating["B", "H", "T", "D"],
    k: ac.floating["B", "H", "S", "D"],
    v: ac.floating["B", "H", "S", "D"],
    slopes: ac.f32["H"],
):
    """``causal_alibi_any`` with the slopes float32 whatever the call's type, as models keep them."""
    s = (q @ k.mT) * q.shape[-1] ** -0.5
    b, h, i, j = ac.index(s)
    return ac.softmax(ac.where(j <= i, s + slopes[h] * (j - i), -ac.inf), axis=-1) @ v
