"""Serving rows of ``python -m benchmarks.cpu``: fn.paged_decoder against its peers.

(a) 32 sequences sharing a 4096-token prompt, 16 tokens of their own each, one
    decode step for all: the paged decoder (the prompt attended once, in cascade)
    against torch SDPA over the batch of contiguous caches.
(b) 64 sequences of random lengths 128..4096, one decode step: against looping 64
    ``fn.decoder`` steps, and against torch SDPA over the padded batch (a mask hides
    the padding).
(c) memory: the pool's bytes in use against 64 contiguous caches of 4096 positions.

``benchmarks.gpu`` runs the same rows on the cuda backend (the pool in device memory, the
torch peer on the GPU; steps take and give host arrays, so their times include the copies
of the new tokens in and the outputs out).

Each comparison alternates the two calls and reports the median of the per-pair
ratios.  A paged step appends its token, so the repeated steps grow every sequence
by one position per repeat; the peers' caches stay as they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

import attncomp as ac
from benchmarks import peers, specs
from benchmarks.timing import check, paired

H, D = 8, 64


def tokens(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """q, k and v of ``n`` new tokens of one sequence, ``[1, H, n, D]`` float32."""
    return tuple(rng.standard_normal((1, H, n, D), dtype=np.float32) for _ in range(3))


def _on(torch, backend: str):
    """Where the torch peer runs (the GPU for the cuda backend) and a call that waits for it."""
    device = "cuda" if backend == "cuda" else "cpu"

    def tensor(x: np.ndarray):
        return torch.from_numpy(x).to(device)

    def done(call):
        def timed():
            out = call()
            if device == "cuda":
                torch.cuda.synchronize()
            return out

        return timed

    return tensor, done


@dataclass
class SharedPrompt:
    """A paged decoder serving ``users`` sequences forked from one prompt, each with tokens of its own,
    and the next token of each (a step of ``token`` grows every sequence by one)."""

    srv: Any
    prefix: tuple[np.ndarray, ...]
    mine: dict[int, tuple[np.ndarray, ...]]
    token: dict[int, tuple[np.ndarray, ...]]

    @property
    def seqs(self) -> list[int]:
        return list(self.token)


def shared_prompt(backend: str, users: int, prompt: int, own: int, steps: int) -> SharedPrompt:
    """The shared-prompt row's server (``specs.causal``, pages of 16), its pool sized for ``steps``
    steps of a token each after the users' own tokens."""
    rng = np.random.default_rng(7)
    fn = ac.compile(specs.causal, backend=backend)
    srv = fn.paged_decoder(page_size=16, num_pages=(prompt // 16 + 1) + users * -(-(own + steps + 16) // 16))
    root = srv.new()
    prefix = tokens(rng, prompt)
    srv.step({root: prefix})
    seqs = [srv.fork(root) for _ in range(users)]
    srv.free(root)
    mine = {s: tokens(rng, own) for s in seqs}
    srv.step(mine)
    return SharedPrompt(srv, prefix, mine, {s: tokens(rng, 1) for s in seqs})


def shared_prompt_rows(quick: bool, repeats: int, backend: str = "cpu") -> list[str]:
    torch = peers.torch_or_none()
    if torch is None:
        return ["  paged, shared prompt: torch is absent, nothing to compare with"]
    tensor, done = _on(torch, backend)
    users, prompt, own = (8, 1024, 16) if quick else (32, 4096, 16)
    served = shared_prompt(backend, users, prompt, own, steps=48)
    srv, prefix, mine, token, seqs = served.srv, served.prefix, served.mine, served.token, served.seqs
    # the peer: one contiguous cache per sequence (prompt, own tokens, the new token), batched
    kc = tensor(np.concatenate([np.concatenate([prefix[1], mine[s][1], token[s][1]], axis=2) for s in seqs]))
    vc = tensor(np.concatenate([np.concatenate([prefix[2], mine[s][2], token[s][2]], axis=2) for s in seqs]))
    qs = tensor(np.concatenate([token[s][0] for s in seqs]))

    @done
    def peer():
        return torch.nn.functional.scaled_dot_product_attention(qs, kc, vc)

    first = srv.step(token)
    check("paged shared prompt", np.concatenate([first[s] for s in seqs]), peer().cpu().numpy())
    cascades = srv.cascades
    ours, theirs, ratio = paired(lambda: srv.step(token), peer, max(repeats, 5))
    assert srv.cascades > cascades, "the shared prompt was not attended in cascade"
    return [
        f"  paged decode step ({backend}), {users} sequences sharing a {prompt}-token prompt (+{own} own), "
        f"H={H} D={D}: {ours * 1e3:.1f} ms; torch SDPA over the batch of contiguous caches {theirs * 1e3:.1f} ms, "
        f"ratio {ratio:.2f}"
    ]


def ragged_rows(quick: bool, repeats: int, backend: str = "cpu") -> list[str]:
    n_seq, longest = (16, 1024) if quick else (64, 4096)
    rng = np.random.default_rng(8)
    lengths = rng.integers(128, longest + 1, size=n_seq)
    fn = ac.compile(specs.causal, backend=backend)
    page = 16
    srv = fn.paged_decoder(page_size=page, num_pages=int(sum(-(-(n + 64) // page) for n in lengths)))
    decoders, seqs, histories = [], [], []
    for n in lengths:
        history = tokens(rng, int(n))
        seq = srv.new()
        srv.step({seq: history})
        dec = fn.decoder(max_len=longest + 64)
        dec(*history)
        seqs.append(seq)
        decoders.append(dec)
        histories.append(history)
    token = {s: tokens(rng, 1) for s in seqs}

    def loop():
        out = []
        for dec, s in zip(decoders, seqs):  # each appends its token, as the paged steps do
            out.append(dec(*token[s]))
        return out

    first = srv.step(token)
    want = loop()
    check("paged ragged", np.concatenate([first[s] for s in seqs]), np.concatenate(want))
    ours, looping, ratio_loop = paired(lambda: srv.step(token), loop, max(repeats, 5))
    lines = [
        f"  paged decode step ({backend}), {n_seq} sequences of random lengths 128..{longest}: {ours * 1e3:.1f} ms; "
        f"looping {n_seq} fn.decoder steps {looping * 1e3:.1f} ms, ratio {ratio_loop:.2f}"
    ]
    torch = peers.torch_or_none()
    if torch is not None:
        tensor, done = _on(torch, backend)
        width = int(max(srv.length(s) for s in seqs))
        kc = np.zeros((n_seq, H, width, D), np.float32)
        vc = np.zeros_like(kc)
        mask = np.zeros((n_seq, 1, 1, width), bool)
        for b, (s, history) in enumerate(zip(seqs, histories)):
            n = history[1].shape[2]
            kc[b, :, :n], vc[b, :, :n] = history[1][0], history[2][0]
            kc[b, :, n], vc[b, :, n] = token[s][1][0, :, 0], token[s][2][0, :, 0]
            mask[b, ..., : n + 1] = True
        tk, tv, tm = tensor(kc), tensor(vc), tensor(mask)
        tq = tensor(np.concatenate([token[s][0] for s in seqs]))

        @done
        def padded():
            return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, attn_mask=tm)

        check("paged ragged vs torch", np.concatenate([first[s] for s in seqs]), padded().cpu().numpy())
        ours, theirs, ratio = paired(lambda: srv.step(token), padded, max(repeats, 5))
        lines.append(
            f"    torch SDPA over the padded batch ({width} wide, masked): {theirs * 1e3:.1f} ms, ratio {ratio:.2f}"
        )
    row = srv.pool.bytes_per_position
    used = (srv.pool.num_pages - srv.pages_free) * page * row
    contiguous = n_seq * longest * row
    lines.append(
        f"  memory: the pool holds {used / 1e6:.0f} MB in pages for {n_seq} sequences, against "
        f"{contiguous / 1e6:.0f} MB for {n_seq} contiguous caches of {longest} positions ({used / contiguous:.0%})"
    )
    return lines


def serving_rows(quick: bool, repeats: int, backend: str = "cpu") -> list[str]:
    """The rows for ``backend``: "cpu", or "cuda" (the pool on the GPU, torch's peer there too)."""
    return shared_prompt_rows(quick, repeats, backend) + ragged_rows(quick, repeats, backend)
