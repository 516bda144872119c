"""Small specs the pass tests share."""

# ruff: noqa: F821
import attncomp as ac


@ac.spec
def causal(q: ac.f32["B", "H", "T", "D"], k: ac.f32["B", "H", "S", "D"], v: ac.f32["B", "H", "S", "D"]):
    s = (q @ k.mT) * q.shape[-1] ** -0.5
    b, h, i, j = ac.index(s)
    s = ac.where(j <= i, s, -ac.inf)
    return ac.softmax(s, axis=-1) @ v


@ac.spec
def causal_alibi(
    q: ac.f32["B", "H", "T", "D"],
    k: ac.f32["B", "H", "S", "D"],
    v: ac.f32["B", "H", "S", "E"],
    slopes: ac.f32["H"],
    *,
    window: int = 256,
):
    s = (q @ k.mT) * q.shape[-1] ** -0.5
    b, h, i, j = ac.index(s)
    s = s + slopes[h] * (j - i)
    s = ac.where((j <= i) & (i - j < window), s, -ac.inf)
    return ac.softmax(s, axis=-1) @ v


@ac.spec
def spelled_gqa_lse(q: ac.f32["B", "H", "T", "D"], k: ac.f32["B", "KV", "S", "D"], v: ac.f32["B", "KV", "S", "D"]):
    q = q * q.shape[-1] ** -0.5
    n_rep = q.shape[1] // k.shape[1]
    s = q @ ac.repeat_kv(k, n_rep).mT
    m = ac.max(s, -1, keepdims=True)
    e = ac.exp(s - m)
    p = e / ac.sum(e, -1, keepdims=True)
    return p @ ac.repeat_kv(v, n_rep), ac.logsumexp(s, -1)


@ac.spec
def returns_probabilities(q: ac.f32["T", "D"], k: ac.f32["S", "D"], v: ac.f32["S", "D"]):
    p = ac.softmax(q @ k.mT)
    return p @ v, p


@ac.spec
def document(
    q: ac.f32["B", "H", "T", "D"],
    k: ac.f32["B", "H", "T", "D"],
    v: ac.f32["B", "H", "T", "D"],
    doc: ac.i32["B", "T"],
):
    s = (q @ k.mT) * q.shape[-1] ** -0.5
    b, h, i, j = ac.index(s)
    return ac.softmax(ac.where((doc[b, i] == doc[b, j]) & (j <= i), s, -ac.inf)) @ v


@ac.spec
def window(
    q: ac.f32["B", "H", "T", "D"],
    k: ac.f32["B", "H", "T", "D"],
    v: ac.f32["B", "H", "T", "D"],
    *,
    size: int = 64,
):
    s = (q @ k.mT) * q.shape[-1] ** -0.5
    b, h, i, j = ac.index(s)
    return ac.softmax(ac.where((j <= i) & (i - j < size), s, -ac.inf)) @ v


@ac.spec
def unmasked(q: ac.f32["T", "D"], k: ac.f32["S", "D"], v: ac.f32["S", "E"]):
    return ac.softmax(q @ k.mT / 2.0) @ v


@ac.spec
def causal_2d(q: ac.f32["T", "D"], k: ac.f32["T", "D"], v: ac.f32["T", "D"]):
    s = q @ k.mT
    i, j = ac.index(s)
    return ac.softmax(ac.where(j <= i, s, -ac.inf)) @ v


@ac.spec
def learned_temperature(q: ac.f32["T", "D"], k: ac.f32["S", "D"], v: ac.f32["S", "D"], t: ac.f32[1]):
    s = (q @ k.mT) * t[0]
    return ac.softmax(s, axis=-1) @ v


@ac.spec
def generic_alibi(
    q: ac.floating["B", "H", "T", "D"],
    k: ac.floating["B", "H", "S", "D"],
    v: ac.floating["B", "H", "S", "D"],
    slopes: ac.floating["H"],
):
    """ALiBi for every float type (``ac.floating``): compiled per type the calls bring."""
    s = (q @ k.mT) * q.shape[-1] ** -0.5
    b, h, i, j = ac.index(s)
    s = ac.where(j <= i, s + slopes[h] * (j - i), -ac.inf)
    return ac.softmax(s, axis=-1) @ v


@ac.spec
def dense(
    q: ac.f32["B", "H", "T", "D"],
    k: ac.f32["B", "H", "S", "D"],
    v: ac.f32["B", "H", "S", "D"],
    m: ac.bool_["B", "T", "S"],
):
    s = (q @ k.mT) * q.shape[-1] ** -0.5
    b, h, i, j = ac.index(s)
    return ac.softmax(ac.where(m[b, i, j], s, -ac.inf)) @ v


@ac.spec
def dense_bias(
    q: ac.f32["B", "H", "T", "D"],
    k: ac.f32["B", "H", "S", "D"],
    v: ac.f32["B", "H", "S", "D"],
    bias: ac.f32["B", "H", "T", "S"],
):
    """An additive mask per head, as PyTorch's SDPA takes one: ``-inf`` hides a key."""
    s = (q @ k.mT) * q.shape[-1] ** -0.5
    b, h, i, j = ac.index(s)
    return ac.softmax(ac.where(bias[b, h, i, j] > -ac.inf, s + bias[b, h, i, j], -ac.inf)) @ v


@ac.spec
def block_table(
    q: ac.f32["B", "H", "T", "D"],
    k: ac.f32["B", "H", "S", "D"],
    v: ac.f32["B", "H", "S", "D"],
    table: ac.i32["H", "QB", "KB"],
    *,
    rows: int = 16,
    cols: int = 16,
):
    """A mask of blocks of ``rows`` queries by ``cols`` keys (as FlexAttention's lists): 0 hidden,
    2 shown whole, 1 shown up to the diagonal."""
    s = (q @ k.mT) * q.shape[-1] ** -0.5
    b, h, i, j = ac.index(s)
    code = table[h, i // rows, j // cols]
    return ac.softmax(ac.where((code == 2) | ((code == 1) & (j <= i)), s, -ac.inf)) @ v


@ac.spec
def sigmoid_gated(
    q: ac.f32["B", "H", "T", "D"], k: ac.f32["B", "H", "S", "D"], v: ac.f32["B", "H", "S", "D"], gate: ac.f32["H"]
):
    """Causal attention whose scores each head scales by a learned gate in (0, 1)."""
    s = (q @ k.mT) * q.shape[-1] ** -0.5
    b, h, i, j = ac.index(s)
    s = ac.where(j <= i, s * ac.sigmoid(gate[h]), -ac.inf)
    return ac.softmax(s, axis=-1) @ v


@ac.spec
def sigmoid_alibi(
    q: ac.f32["B", "H", "T", "D"], k: ac.f32["B", "H", "S", "D"], v: ac.f32["B", "H", "S", "E"], slopes: ac.f32["H"]
):
    """Sigmoid attention (no softmax) with ALiBi slopes, causal by the logistic function of ``-inf``."""
    s = (q @ k.mT) * q.shape[-1] ** -0.5
    b, h, i, j = ac.index(s)
    return ac.sigmoid(ac.where(j <= i, s + slopes[h] * (j - i) - 2.0, -ac.inf)) @ v
