"""Training a tiny causal language model whose attention is an attncomp spec (needs the torch extra).

    python examples/train_tiny_lm.py            # 300 steps of Adam on a copying task, both attentions
    python examples/train_tiny_lm.py --device cuda --dtype bf16 --attention causal --half 1024 \
        --width 512 --heads 8 --layers 4 --batch 8   # bf16 on a GPU, against SDPA, T = 2047

The attention is ALiBi with soft-capped scores and learnable per-head slopes,
written once in the DSL; ``fn.to_torch()`` makes it a differentiable torch op,
so the model trains with ``loss.backward()`` like any other.  The same model
with the same formula written in torch ops (and the same initial weights) is
trained beside it: the two loss curves agree step by step, and the script
prints both curves' start and end and the tokens per second of each.

The task: a sequence of random tokens followed by itself; the model learns to
copy, which needs attention to look back exactly ``half`` positions (the loss
is taken on the second half only).

``--attention causal`` trains plain causal attention instead, whose torch twin is
``scaled_dot_product_attention(is_causal=True)``; ``--device cuda`` runs the model and
attncomp's kernels (``backend="cuda"``) on the GPU; ``--dtype bf16`` (or ``f16``) makes
the model's weights and activations that type: the specs are generic (``ac.floating``),
so the attention runs in the call's type, on tensor cores on the GPU.
"""

# Dimension names such as ac.f32["B", "T"] are sizes, not forward references.
# ruff: noqa: F821

import argparse
import time

import numpy as np

import attncomp as ac


@ac.spec
def alibi_softcap(
    q: ac.floating["B", "H", "T", "D"],
    k: ac.floating["B", "H", "S", "D"],
    v: ac.floating["B", "H", "S", "E"],
    slopes: ac.floating["H"],
    *,
    cap: float = 20.0,
):
    s = (q @ k.mT) * q.shape[-1] ** -0.5
    s = cap * ac.tanh(s / cap)
    b, h, i, j = ac.index(s)
    s = s + slopes[h] * (j - i)
    s = ac.where(j <= i, s, -ac.inf)
    return ac.softmax(s, axis=-1) @ v


def causal_spec() -> ac.Spec:
    """Plain causal attention, the twin of SDPA's ``is_causal=True`` (``--attention causal``)."""

    @ac.spec
    def causal(
        q: ac.floating["B", "H", "T", "D"], k: ac.floating["B", "H", "S", "D"], v: ac.floating["B", "H", "S", "E"]
    ):
        s = (q @ k.mT) * q.shape[-1] ** -0.5
        b, h, i, j = ac.index(s)
        return ac.softmax(ac.where(j <= i, s, -ac.inf), axis=-1) @ v

    return causal


def numpy_reference(q, k, v, slopes, *, cap: float = 20.0) -> np.ndarray:
    q, k, v, slopes = (np.asarray(a, dtype=np.float64) for a in (q, k, v, slopes))
    T, S = q.shape[-2], k.shape[-2]
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    s = cap * np.tanh(s / cap)
    distance = np.arange(S)[None, :] - np.arange(T)[:, None]
    s = s + slopes[None, :, None, None] * distance
    s = np.where(distance <= 0, s, -np.inf)
    w = np.exp(s - s.max(axis=-1, keepdims=True))
    return (w / w.sum(axis=-1, keepdims=True)) @ v


def make_inputs(rng: np.random.Generator, *, B=1, H=2, T=16, S=16, D=8, E=8) -> list[np.ndarray]:
    q = rng.standard_normal((B, H, T, D), dtype=np.float32)
    k = rng.standard_normal((B, H, S, D), dtype=np.float32)
    v = rng.standard_normal((B, H, S, E), dtype=np.float32)
    return [q, k, v, np.linspace(0.5, 0.05, H, dtype=np.float32)]


def torch_attention(torch, q, k, v, slopes, cap: float = 20.0):
    """The same formula in torch ops (builds the T x S scores, as a plain implementation does)."""
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    s = cap * torch.tanh(s / cap)
    t = q.shape[-2]
    distance = torch.arange(t, device=q.device)[None, :] - torch.arange(t, device=q.device)[:, None]
    s = s + slopes[None, :, None, None] * distance
    s = s.masked_fill(distance > 0, float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def build_model(torch, attention, vocab: int = 16, width: int = 32, heads: int = 2, layers: int = 2):
    """Embedding, ``layers`` pre-norm blocks (attention with learnable slopes, MLP), a head."""
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
            self.qkv = nn.Linear(width, 3 * width)
            self.proj = nn.Linear(width, width)
            self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
            self.slopes = nn.Parameter(torch.linspace(0.5, 0.05, heads))

        def forward(self, x):
            b, t, c = x.shape
            q, k, v = self.qkv(self.norm1(x)).split(c, dim=-1)
            q, k, v = (y.reshape(b, t, heads, c // heads).transpose(1, 2) for y in (q, k, v))
            y = attention(q, k, v, self.slopes).transpose(1, 2).reshape(b, t, c)
            x = x + self.proj(y)
            return x + self.mlp(self.norm2(x))

    class TinyLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab, width)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.head = nn.Linear(width, vocab)

        def forward(self, tokens):
            x = self.embed(tokens)
            for block in self.blocks:
                x = block(x)
            return self.head(x)

    return TinyLM()


def copy_batch(rng: np.random.Generator, batch: int, half: int, vocab: int) -> np.ndarray:
    first = rng.integers(0, vocab, (batch, half))
    return np.concatenate([first, first], axis=1)


#: torch's dtypes by the names the command line takes
DTYPES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16"}


def trainer(
    kind: str,
    *,
    seed: int = 0,
    batch: int = 16,
    half: int = 16,
    vocab: int = 16,
    device: str = "cpu",
    dtype: str = "f32",
    attention: str = "alibi_softcap",
    width: int = 32,
    heads: int = 2,
    layers: int = 2,
):
    """A training step of the model with ``kind`` = "attncomp" or "torch" attention: a function
    that takes one Adam step on a fresh batch and returns its loss (a float: the step is done).

    ``attention``: "alibi_softcap" (torch twin: the formula in torch ops) or "causal" (torch twin:
    SDPA); ``device``: "cpu" or "cuda" (attncomp's cuda backend); ``dtype``: "f32", "bf16", "f16"."""
    import torch

    torch.manual_seed(seed)
    if kind == "attncomp":
        spec = alibi_softcap if attention == "alibi_softcap" else causal_spec()
        op = ac.compile(spec, backend="cuda" if device == "cuda" else "cpu").to_torch()
        if attention == "causal":

            def attend(q, k, v, slopes):
                return op(q, k, v)

        else:
            attend = op
    elif attention == "causal":

        def attend(q, k, v, slopes):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    else:

        def attend(q, k, v, slopes):
            return torch_attention(torch, q, k, v, slopes)

    model = build_model(torch, attend, vocab=vocab, width=width, heads=heads, layers=layers)
    model = model.to(device=device, dtype=getattr(torch, DTYPES[dtype]))
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    rng = np.random.default_rng(seed)

    def step() -> float:
        tokens = torch.from_numpy(copy_batch(rng, batch, half, vocab)).to(device)
        logits = model(tokens[:, :-1]).float()
        # the loss of the copied half: positions half-1 .. 2*half-2 predict tokens half .. 2*half-1
        loss = torch.nn.functional.cross_entropy(logits[:, half - 1 :].reshape(-1, vocab), tokens[:, half:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss.item()

    return step


def train(kind: str, steps: int, **options):
    """Train with ``kind`` = "attncomp" or "torch" attention (``options``: ``trainer``'s); return
    (losses, tokens per second after the first step, which compiles or warms up)."""
    step = trainer(kind, **options)
    losses = [step()]
    start = time.perf_counter()
    losses += [step() for _ in range(steps - 1)]
    seconds = time.perf_counter() - start
    tokens = options.get("batch", 16) * (2 * options.get("half", 16) - 1)
    return losses, (steps - 1) * tokens / seconds


def train_side_by_side(steps: int, **options):
    """Both models trained together, a step of one then a step of the other, each step timed:
    (attncomp's losses, torch's, attncomp's median step seconds, torch's, the median of the
    per-step ratios of attncomp's time to torch's).  Alternating keeps the shared machine's
    changing load out of the ratio."""
    ours, theirs = trainer("attncomp", **options), trainer("torch", **options)
    losses: tuple[list[float], list[float]] = ([ours()], [theirs()])  # compiles, warms up: not timed
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(steps - 1):
        for k, step in enumerate((ours, theirs)):
            start = time.perf_counter()
            losses[k].append(step())
            times[k].append(time.perf_counter() - start)
    ratios = sorted(a / b for a, b in zip(*times))
    return (*losses, float(np.median(times[0])), float(np.median(times[1])), ratios[len(ratios) // 2])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="f32")
    parser.add_argument("--attention", choices=["alibi_softcap", "causal"], default="alibi_softcap")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--half", type=int, default=16, help="copied tokens: sequences of 2 half - 1")
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args(argv)
    steps = args.steps
    options = {k: getattr(args, k) for k in ("batch", "half", "device", "dtype", "attention", "width", "heads")}
    options["layers"] = args.layers
    twin = "SDPA" if args.attention == "causal" else "torch ops"
    ours, theirs, ours_step, their_step, ratio = train_side_by_side(steps, **options)
    first = max(abs(a - b) / abs(b) for a, b in zip(ours[:20], theirs[:20]))
    tokens = args.batch * (2 * args.half - 1)
    print(f"{args.attention} attention, {args.dtype} on {args.device}, T = {2 * args.half - 1}")
    print(f"loss, attncomp attention: {ours[0]:.4f} at step 1, {ours[-1]:.4f} at step {steps}")
    print(f"loss, {twin + ' attention:':21s}{theirs[0]:.4f} at step 1, {theirs[-1]:.4f} at step {steps}")
    print(f"largest relative difference of the two curves over the first 20 steps: {first:.2e}")
    for step in (1, 10, 20, 50, 100, 200, 300):
        if step <= steps:
            print(f"  step {step:4d}: attncomp {ours[step - 1]:.4f}   {twin} {theirs[step - 1]:.4f}")
    print(
        f"tokens/s (median step, the two models' steps alternated): attncomp {tokens / ours_step:,.0f}, "
        f"{twin} {tokens / their_step:,.0f}; attncomp's step time over {twin}'s, median of the pairs: {ratio:.2f}"
    )


if __name__ == "__main__":
    main()
