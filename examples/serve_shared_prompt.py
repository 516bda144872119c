"""Serving a batch of sequences that share a system prompt, through the nanochat layer (fn.paged_decoder).

    python examples/serve_shared_prompt.py            # 8 sequences, a 200-token prompt, 24 steps

The prompt is prefilled once, in one sequence; every user's sequence is a
fork of it, so the prompt's keys and values are stored once in the pool and,
at each step, read once for all of them (cascade attention).  Each user then
brings a turn of their own (a prefill of a few tokens) and decodes one token
per step, all users in one ``step`` call: ragged, no padding.  A layer has no
vocabulary, so the "next token" fed back is the layer's own output.  At the
end every sequence is checked against one whole-sequence call of the layer on
its history, and the pool's pages are compared with one contiguous cache per
sequence.
"""

import sys
from pathlib import Path

import numpy as np

import attncomp as ac

sys.path.insert(0, str(Path(__file__).resolve().parent))  # nanochat_attention.py sits next to this file
import nanochat_attention as layer  # noqa: E402

# the layer served, with its inputs and its numpy formula (the example tests check the spec itself)
nanochat_attention, make_inputs, numpy_reference = layer.nanochat_attention, layer.make_inputs, layer.numpy_reference


def serve(
    backend: str = "cpu",
    users: int = 8,
    prompt: int = 200,
    turn: int = 12,
    steps: int = 24,
    page_size: int = 16,
    seed: int = 0,
) -> dict[str, float]:
    rng = np.random.default_rng(seed)
    x_prompt, *weights = layer.make_inputs(rng, B=1, T=prompt, C=24, n_head=6, n_kv_head=2)
    fn = ac.compile(layer.nanochat_attention, backend=backend, n_head=6, n_kv_head=2)
    num_pages = 64 + users * -(-(turn + steps) // page_size)
    srv = fn.paged_decoder(page_size=page_size, num_pages=num_pages)

    root = srv.new()
    srv.step({root: (x_prompt, *weights)})  # the shared prompt, prefilled once
    seqs = [srv.fork(root) for _ in range(users)]
    srv.free(root)  # its pages live on in the forks
    history = {s: [x_prompt] for s in seqs}
    outputs = {s: [] for s in seqs}

    # each user's own turn: prefills of different lengths, in one step
    turns = {s: rng.standard_normal((1, int(rng.integers(1, turn + 1)), 24), dtype=np.float32) for s in seqs}
    ys = srv.step({s: (x, *weights) for s, x in turns.items()})
    for s in seqs:
        history[s].append(turns[s])
        outputs[s].append(ys[s])
    for _ in range(steps):  # then one token per user per step
        nxt = {s: outputs[s][-1][:, -1:] for s in seqs}
        ys = srv.step({s: (x, *weights) for s, x in nxt.items()})
        for s in seqs:
            history[s].append(nxt[s])
            outputs[s].append(ys[s])

    error = 0.0
    for s in seqs:
        whole = fn(np.concatenate(history[s], axis=1), *weights)[:, prompt:]
        got = np.concatenate(outputs[s], axis=1)
        error = max(error, float(np.max(np.abs(got - whole)) / np.max(np.abs(whole))))
    lengths = [srv.length(s) for s in seqs]
    row_bytes = srv.pool.bytes_per_position
    pages_used = num_pages - srv.pages_free
    return {
        "error": error,
        "cascades": srv.cascades,
        "pool_bytes": pages_used * page_size * row_bytes,
        "contiguous_bytes": sum(lengths) * row_bytes,
        "lengths": lengths,
    }


if __name__ == "__main__":
    report = serve()
    print(f"sequences of lengths {report['lengths']}")
    print(f"largest relative error against whole-sequence calls: {report['error']:.1e}")
    print(f"steps attended in cascade (the prompt read once for every user): {report['cascades']}")
    print(
        f"key/value bytes: {report['pool_bytes'] / 1e3:.0f} kB in pages, "
        f"against {report['contiguous_bytes'] / 1e3:.0f} kB in one contiguous cache per sequence"
    )
