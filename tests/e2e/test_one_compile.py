"""One compile for every length: a compiled function called at 500 distinct (query, key)
lengths, 1 and primes among them, and a decoder stepping through 500 cache lengths, compile
nothing after their first call (``attncomp.testing.counting_compiles``)."""

from __future__ import annotations

import itertools

import numpy as np

import attncomp as ac
from attncomp.testing import counting_compiles
from examples.causal import causal, numpy_reference

D = 16


def primes_below(n: int) -> list[int]:
    sieve = np.ones(n, bool)
    sieve[:2] = False
    for p in range(2, int(n**0.5) + 1):
        sieve[p * p :: p] = False
    return np.flatnonzero(sieve).tolist()


def length_pairs(count: int, longest: int) -> list[tuple[int, int]]:
    """``count`` distinct (query, key) lengths, each 1 or a prime below ``longest``: (1, 1) and
    (1, 2) first, the rest drawn at random."""
    lengths = [1, *primes_below(longest)]
    pairs = list(itertools.product(lengths, lengths))
    order = np.random.default_rng(2).permutation(len(pairs))
    rest = [pairs[n] for n in order if pairs[n] not in ((1, 1), (1, 2))]
    return [(1, 1), (1, 2), *rest[: count - 2]]


def tokens(rng, n: int) -> np.ndarray:
    return rng.standard_normal((1, 2, n, D)).astype(np.float32)


def test_500_lengths_compile_nothing_after_the_first_call():
    fn = ac.compile(causal, backend="cpu")
    rng = np.random.default_rng(0)
    fn(tokens(rng, 4), tokens(rng, 4), tokens(rng, 4))  # compiles, or loads the disk cache
    pairs = length_pairs(500, 300)
    assert len(set(pairs)) == 500
    with counting_compiles() as compiled:
        for n, (t, s) in enumerate(pairs):
            q, k, v = tokens(rng, t), tokens(rng, s), tokens(rng, s)
            out = np.asarray(fn(q, k, v))
            if n % 50 == 0:  # the results are right too, at a few of the lengths
                np.testing.assert_allclose(out, numpy_reference(q, k, v), rtol=2e-4, atol=2e-5)
    assert compiled == []


def test_a_decoder_through_500_cache_lengths_compiles_nothing_after_its_first_step():
    fn = ac.compile(causal, backend="cpu")
    rng = np.random.default_rng(1)
    q, k, v = tokens(rng, 501), tokens(rng, 501), tokens(rng, 501)
    decoder = fn.decoder(max_len=512)
    decoder(q[:, :, :1], k[:, :, :1], v[:, :, :1])
    with counting_compiles() as compiled:
        for n in range(1, 501):
            out = decoder(q[:, :, n : n + 1], k[:, :, n : n + 1], v[:, :, n : n + 1])
    assert compiled == []
    want = numpy_reference(q, k, v)[:, :, -1:]
    np.testing.assert_allclose(np.asarray(out), want, rtol=2e-4, atol=2e-5)
