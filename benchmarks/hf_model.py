"""A Hugging Face Llama training step with attncomp's attention against the same model on ``sdpa``,
and a T5 step (its learned relative positions reach the attention as a position bias).

    python -m benchmarks.hf_model            # T = 4096 (dropout: 2048, T5: 1024); --quick: smaller, fewer repeats

The model: 4 layers of width 512, 8 query heads over 2 key/value heads (head size 64), MLP
width 1408, a vocabulary of 4096, random weights from the config (nothing downloaded),
float32, batch 1. A step is the forward with the language-model loss and its backward.
The two models have the same weights and are called alternately; the ratio is the median
of the per-pair ratios (``benchmarks/timing.py``). The attention's share of a step is the
time of the attention alone (forward and backward of one layer's attention on the step's
shapes, times the layers) over the step's time, for each implementation.
"""

from __future__ import annotations

import argparse
import copy
import os
import time
from collections.abc import Sequence
from typing import Any

LAYERS, WIDTH, HEADS, KV_HEADS, MLP, VOCAB = 4, 512, 8, 2, 1408, 4096


def build(torch, transformers, implementation: str, seed: int = 0, dropout: float = 0.0):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=WIDTH,
        intermediate_size=MLP,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=16384,
        attention_dropout=dropout,
    )
    return transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=implementation)


def llama_pair(torch, transformers, T: int, dropout: float = 0.0) -> tuple[Any, Any, Any]:
    """(the model on attncomp, the same weights on ``sdpa``, a sequence of ``T`` token ids); in
    training mode where they drop out attention."""
    ours = build(torch, transformers, "attncomp", dropout=dropout)
    theirs = build(torch, transformers, "sdpa", dropout=dropout)
    theirs.load_state_dict(ours.state_dict())
    if dropout:
        ours.train(), theirs.train()
    return ours, theirs, torch.randint(0, VOCAB, (1, T), generator=torch.Generator().manual_seed(0))


def step(model, ids) -> float:
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    return loss.item()


def attention_alone(torch, attention, T: int):
    """One layer's attention, forward and backward, on the step's shapes (a closure to time)."""
    generator = torch.Generator().manual_seed(1)
    head = WIDTH // HEADS
    q = torch.randn(1, HEADS, T, head, generator=generator, requires_grad=True)
    k = torch.randn(1, KV_HEADS, T, head, generator=generator, requires_grad=True)
    v = torch.randn(1, KV_HEADS, T, head, generator=generator, requires_grad=True)

    def run() -> None:
        out = attention(q, k, v)
        out.backward(torch.ones_like(out))

    return run


def libraries(case: str) -> Any:
    """``(torch, transformers)`` with ``attn_implementation="attncomp"`` registered, or the line
    saying why ``case`` is skipped (without the torch or hf extra)."""
    try:
        import torch
        import transformers
    except ImportError as error:
        return f"HF {case} step: skipped ({error.name} is not installed; the torch and hf extras)"
    import attncomp.hf

    attncomp.hf.register()
    return torch, transformers


def check_losses(case: str, losses: Sequence[float]) -> None:
    """The two models' first losses, the same weights on both: they agree, or the timing is meaningless."""
    if abs(losses[0] - losses[1]) > 1e-4 * abs(losses[1]):
        raise AssertionError(f"the two {case} models' losses differ: {losses}")


def rows(quick: bool = False, repeats: int | None = None) -> list[str]:
    """The table's two lines (one saying why, without torch or transformers)."""
    found = libraries("Llama")
    if isinstance(found, str):
        return [found]
    torch, transformers = found
    from attncomp.hf.specs import hf_attention
    from benchmarks.timing import paired

    T = 1024 if quick else 4096
    repeats = repeats or (3 if quick else 7)
    ours, theirs, ids = llama_pair(torch, transformers, T)
    check_losses("Llama", [step(ours, ids), step(theirs, ids)])
    mine, peer, ratio = paired(lambda: step(ours, ids), lambda: step(theirs, ids), repeats)

    import attncomp as ac

    op = ac.compile(hf_attention, backend="cpu", scale=(WIDTH // HEADS) ** -0.5).to_torch()
    shift = torch.zeros(1, dtype=torch.int32)
    our_attention = attention_alone(torch, lambda q, k, v: op(q, k, v, shift), T)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    their_attention = attention_alone(torch, lambda q, k, v: sdpa(q, k, v, is_causal=True, enable_gqa=True), T)
    attn_mine, attn_peer, _ = paired(our_attention, their_attention, repeats)
    return [
        f"HF Llama step (forward + backward, {LAYERS} layers, width {WIDTH}, GQA {HEADS}/{KV_HEADS}, T={T}, "
        f"batch 1, float32): attncomp {mine * 1e3:.0f} ms, sdpa {peer * 1e3:.0f} ms, ratio {ratio:.2f} "
        f"(median of {repeats} pairs)",
        f"  the attention's share of the step: attncomp {LAYERS * attn_mine / mine:.0%} "
        f"({LAYERS} x {attn_mine * 1e3:.0f} ms), sdpa {LAYERS * attn_peer / peer:.0%} "
        f"({LAYERS} x {attn_peer * 1e3:.0f} ms)",
    ]


def dropout_rows(quick: bool = False, repeats: int | None = None, rate: float = 0.1) -> list[str]:
    """The Llama step in training mode with attention dropout: attncomp's ``ac.dropout`` in its kernels
    against ``sdpa``'s ``dropout_p`` (other masks, the same law: the losses agree to a few percent)."""
    found = libraries("Llama dropout")
    if isinstance(found, str):
        return [found]
    torch, transformers = found
    from benchmarks.timing import paired

    T = 512 if quick else 2048
    repeats = repeats or (3 if quick else 5)
    ours, theirs, ids = llama_pair(torch, transformers, T, rate)
    losses = [step(ours, ids), step(theirs, ids)]
    if abs(losses[0] - losses[1]) > 0.05 * abs(losses[1]):
        raise AssertionError(f"the two Llama dropout models' losses differ by more than dropout would: {losses}")
    mine, peer, ratio = paired(lambda: step(ours, ids), lambda: step(theirs, ids), repeats)
    return [
        f"HF Llama step in training mode, attention dropout {rate} ({LAYERS} layers, T={T}, batch 1, float32): "
        f"attncomp {mine * 1e3:.0f} ms, sdpa {peer * 1e3:.0f} ms, ratio {ratio:.2f} (median of {repeats} pairs)"
    ]


def t5_rows(quick: bool = False, repeats: int | None = None) -> list[str]:
    """A T5 training step: encoder and decoder of 4 layers each (width 512, 8 heads of 64, MLP 1408,
    no dropout), two sequences of T tokens to T targets, the second padded to half; attncomp's
    attention adds the ``[1, H, T, S]`` position bias as one ``[H, T, S]`` tensor for the batch."""
    found = libraries("T5")
    if isinstance(found, str):
        return [found]
    torch, transformers = found
    from benchmarks.timing import paired

    T = 256 if quick else 1024
    repeats = repeats or (3 if quick else 5)
    config = transformers.T5Config(
        vocab_size=VOCAB, d_model=WIDTH, d_kv=WIDTH // HEADS, d_ff=MLP, num_layers=LAYERS, num_heads=HEADS,
        dropout_rate=0.0, decoder_start_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    models = [
        transformers.AutoModelForSeq2SeqLM.from_config(copy.deepcopy(config), attn_implementation=name)
        for name in ("attncomp", "sdpa")
    ]
    models[1].load_state_dict(models[0].state_dict())
    generator = torch.Generator().manual_seed(0)
    ids, labels = (torch.randint(1, VOCAB, (2, T), generator=generator) for _ in range(2))
    mask = torch.ones(2, T, dtype=torch.long)
    mask[1, T // 2 :] = 0

    def t5_step(model) -> float:
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        return loss.item()

    check_losses("T5", [t5_step(m) for m in models])
    mine, peer, ratio = paired(lambda: t5_step(models[0]), lambda: t5_step(models[1]), repeats)
    return [
        f"HF T5 step (forward + backward, {LAYERS} + {LAYERS} layers, width {WIDTH}, {HEADS} heads, T={T}, batch 2 "
        f"padded, float32): attncomp {mine * 1e3:.0f} ms, sdpa {peer * 1e3:.0f} ms, ratio {ratio:.2f} "
        f"(median of {repeats} pairs)"
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="T = 1024 and 3 pairs")
    parser.add_argument("--repeats", type=int, default=None, help="pairs timed")
    args = parser.parse_args()
    import torch

    print(f"torch {torch.__version__}, {torch.get_num_threads()} torch threads, {os.cpu_count()} cores")
    start = time.perf_counter()
    for line in rows(args.quick, args.repeats) + dropout_rows(args.quick, args.repeats):
        print(line)
    for line in t5_rows(args.quick, args.repeats):
        print(line)
    print(f"({time.perf_counter() - start:.0f} s in all, the first step compiling)")


if __name__ == "__main__":
    main()
