"""One sequence alone and inside batches of others: what the batch-invariance tests of the CPU
(``tests/e2e/test_batch_invariant.py``) and of the CUDA simulator
(``tests/cuda_sim/test_sim_batch_invariant.py``) run, and the bitwise comparison they make."""

# (no ``from __future__ import annotations``: a spec's dimension names would become forward references)
# ruff: noqa: F821

import numpy as np

import attncomp as ac

#: the batch sizes a sequence is placed in, beside its run alone (the simulator's tests take smaller
#: ones: ``tests/cuda_sim/test_sim_batch_invariant.py``)
BATCHES = (1, 3, 17)


@ac.spec
def ragged_gqa(
    q: ac.f32["B", "H", "T", "D"],
    k: ac.f32["B", "KV", "S", "D"],
    v: ac.f32["B", "KV", "S", "E"],
    key_count: ac.i64["B"],
    *,
    n_rep: int = 2,
):
    """Grouped-query causal attention (bottom-right aligned) over each sequence's first
    ``key_count[b]`` keys: sequences of different lengths padded into one batch."""
    k = ac.repeat_kv(k, n_rep)
    v = ac.repeat_kv(v, n_rep)
    s = (q @ k.mT) * q.shape[-1] ** -0.5
    b, h, i, j = ac.index(s)
    s = ac.where((j < key_count[b]) & (j <= i + (k.shape[-2] - q.shape[-2])), s, -ac.inf)
    return ac.softmax(s, axis=-1) @ v


@ac.spec
def causal_gqa(
    q: ac.f32["B", "H", "T", "D"],
    k: ac.f32["B", "KV", "S", "D"],
    v: ac.f32["B", "KV", "S", "E"],
    *,
    n_rep: int = 2,
):
    """Grouped-query causal attention: what a decoder and a paged decoder serve."""
    k = ac.repeat_kv(k, n_rep)
    v = ac.repeat_kv(v, n_rep)
    s = (q @ k.mT) * q.shape[-1] ** -0.5
    b, h, i, j = ac.index(s)
    s = ac.where(j <= i, s, -ac.inf)
    return ac.softmax(s, axis=-1) @ v


def same_bits(a, b) -> bool:
    """Bit-equal float32 arrays (NaN and signed zeros compared by their bits)."""
    a, b = np.ascontiguousarray(a, np.float32), np.ascontiguousarray(b, np.float32)
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def tokens(rng: np.random.Generator, n: int, heads=(2, 1, 1), dims=(8, 8, 8), dtype=np.float32) -> list[np.ndarray]:
    """One sequence's q, k, v for ``n`` tokens (batch size 1), of ``dtype``."""
    return [rng.standard_normal((1, h, n, d)).astype(dtype) for h, d in zip(heads, dims)]


def plain_calls(fn, host, rows: int, keys: int, seed: int = 0, batches=BATCHES) -> dict[int, list[np.ndarray]]:
    """``fn(q, k, v, key_count)`` of ``ragged_gqa``: one sequence (``keys`` keys, ``rows`` queries)
    alone, then at a different place in batches of other sequences with random key counts; its
    output row of each call, by batch size (0: alone)."""
    rng = np.random.default_rng(seed)
    mine = tokens(rng, keys)
    q = rng.standard_normal((1, 2, rows, 8)).astype(np.float32)
    seen = {0: [host(fn(q, mine[1], mine[2], np.array([keys], np.int64)))[0]]}
    for n in batches:
        at = (5 * n) // 7  # the sequence's place in the batch
        qs = rng.standard_normal((n, 2, rows, 8)).astype(np.float32)
        ks, vs = (rng.standard_normal((n, 1, keys, 8)).astype(np.float32) for _ in range(2))
        counts = rng.integers(1, keys + 1, n)
        qs[at], ks[at], vs[at], counts[at] = q[0], mine[1][0], mine[2][0], keys
        seen[n] = [host(fn(qs, ks, vs, counts))[at]]
    return seen


def decoder_steps(fn, host, prompt: int, seed: int = 0, batches=BATCHES) -> dict[int, list[np.ndarray]]:
    """``fn.decoder`` steps of ``causal_gqa``: one sequence's prefill of ``prompt`` tokens and two
    single-token steps, alone and in batches of sequences of its length; its outputs of each step."""
    rng = np.random.default_rng(seed)
    mine = [tokens(rng, prompt), tokens(rng, 1), tokens(rng, 1)]
    seen = {}
    for n in (0, *batches):
        at, width = (5 * n) // 7, max(n, 1)
        dec = fn.decoder(max_len=prompt + 4)
        outs = []
        for chunk in mine:
            args = [np.repeat(x, width, axis=0) for x in chunk]
            for x in args:
                x[:] = rng.standard_normal(x.shape)
            for x, own in zip(args, chunk):
                x[at] = own[0]
            outs.append(host(dec(*args))[at])
        seen[n] = outs
    return seen


def paged_steps(
    fn,
    host,
    prompt: int,
    page_size: int = 16,
    seed: int = 0,
    heads=(4, 1, 1),
    dims=(8, 8, 32),
    steps: int = 8,
    cache: str | None = None,
    dtype=np.float32,
    batches=BATCHES,
) -> dict[int, list[np.ndarray]]:
    """``fn.paged_decoder`` steps of ``causal_gqa`` (``heads`` and ``dims`` of q, k, v: four query
    heads a key/value head, 32 value features by default, as its CPU loops take four rows at a time):
    one sequence's prefill of ``prompt`` tokens and ``steps`` single-token steps (each moving the
    width of its last key tile), alone in a fresh pool, and in steps with the other sequences of each
    of ``batches`` (2 and 16 by default), of ragged lengths (one as long as it, whose prefill shares
    its ragged batch; one longer; the rest short), in a pool whose pages were handed out first to a
    sequence freed after, so that the sequence's pages lie elsewhere, among the others'.  In the
    largest batch a fork of the sequence decodes beside it (their shared prompt would be read once,
    in cascade, by default).  Its outputs of each step, by batch size (0: alone).  ``cache``: pools
    of 8-bit pages of that type; ``dtype``: the tokens' element type."""
    rng = np.random.default_rng(seed)

    def tokens_of(n):
        return tokens(rng, n, heads, dims, dtype)

    mine = [tokens_of(prompt)] + [tokens_of(1) for _ in range(steps)]
    pages = 4 * max(batches) * (-(-(2 * prompt + 8 + steps) // page_size))
    srv = fn.paged_decoder(page_size=page_size, num_pages=pages, cache=cache)
    me = srv.new()
    seen = {0: [host(srv.step({me: tuple(chunk)})[me]) for chunk in mine]}
    for n in batches:
        srv = fn.paged_decoder(page_size=page_size, num_pages=pages, cache=cache)
        scratch = srv.new()
        srv.step({scratch: tuple(tokens_of(3 * page_size + 5))})
        lengths = [prompt, prompt + 3 * page_size + 7] + list(rng.integers(1, 4 * page_size, max(n - 3, 0)))
        others = {srv.new(): tuple(tokens_of(int(m))) for m in lengths[: n - 1]}
        me = srv.new()
        outs = [srv.step({**others, me: tuple(mine[0])})[me]]
        srv.free(scratch)
        fork = srv.fork(me) if n == max(batches) else None
        for chunk in mine[1:]:
            batch = {s: tuple(tokens_of(1)) for s in others}
            if fork is not None:
                batch[fork] = tuple(tokens_of(1))
            batch = dict(
                list(batch.items())[: len(batch) // 2] + [(me, tuple(chunk))] + list(batch.items())[len(batch) // 2 :]
            )
            outs.append(srv.step(batch)[me])
        seen[n] = [host(x) for x in outs]
    return seen


def differing(seen: dict[int, list[np.ndarray]]) -> list[str]:
    """The (batch size, step) whose outputs differ from the sequence's own run alone, bit for bit."""
    alone = seen[0]
    return [
        f"batch of {n}, output {s}"
        for n in sorted(seen)
        if n
        for s, (a, b) in enumerate(zip(alone, seen[n]))
        if not same_bits(a, b)
    ]


def gradient_inputs(rng: np.random.Generator, rows: int, keys: int) -> list[np.ndarray]:
    """One sequence's q, k, v and a cotangent of its output (batch size 1)."""
    k, v = tokens(rng, keys)[1:]
    q, d_out = (rng.standard_normal((1, 2, rows, 8)).astype(np.float32) for _ in range(2))
    return [q, k, v, d_out]


def gradient_calls(fn, host, rows: int, keys: int, seed: int = 0, batches=BATCHES) -> dict[int, list[np.ndarray]]:
    """``fn.vjp`` of ``ragged_gqa``: one sequence's output and its dq, dk, dv for one cotangent,
    alone and at a place in batches of other sequences with random key counts, by batch size."""
    rng = np.random.default_rng(seed)
    q, k, v, d_out = gradient_inputs(rng, rows, keys)

    def run(qs, ks, vs, counts, cotangent, at):
        out, pullback = fn.vjp(qs, ks, vs, counts)
        return [host(x)[at] for x in (out, *pullback(cotangent)[:3])]

    seen = {0: run(q, k, v, np.array([keys], np.int64), d_out, 0)}
    for n in batches:
        at = (5 * n) // 7
        qs, cot = (rng.standard_normal((n, 2, rows, 8)).astype(np.float32) for _ in range(2))
        ks, vs = (rng.standard_normal((n, 1, keys, 8)).astype(np.float32) for _ in range(2))
        counts = rng.integers(1, keys + 1, n)
        qs[at], ks[at], vs[at], counts[at], cot[at] = q[0], k[0], v[0], keys, d_out[0]
        seen[n] = run(qs, ks, vs, counts, cot, at)
    return seen
