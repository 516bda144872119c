"""fn.paged_decoder (docs/api.md section 7): many sequences, forks and frees, against whole-sequence calls."""

from dataclasses import dataclass, field

import numpy as np
import pytest

import attncomp as ac
from attncomp.serving import PoolExhausted
from tests.conftest import load_example
from tests.passes import specs

RTOL = 1e-5


@dataclass
class Case:
    """A spec, how to draw a sequence's token inputs, and the inputs every sequence shares."""

    fn: object
    draw: object  # (rng, n) -> token inputs of n tokens
    axes: list[int]  # the token axis of each token input
    shared: list[np.ndarray] = field(default_factory=list)


def alibi_case(backend):
    fn = ac.compile(specs.causal_alibi, backend=backend, window=19)

    def draw(r, n):
        return [r.standard_normal((1, 2, n, 8), dtype=np.float32) for _ in range(3)]

    return Case(fn, draw, [2] * 3, [np.array([0.5, 0.25], np.float32)])


def sinks_case(backend, examples):
    fn = ac.compile(examples["sinks_window"].sinks_window, backend=backend, window=11, sinks=3)
    return Case(fn, lambda r, n: [r.standard_normal((1, 2, n, 8), dtype=np.float32) for _ in range(3)], [2] * 3)


def gqa_case(backend, examples):
    fn = ac.compile(examples["gqa"].grouped_query_attention, backend=backend)

    def draw(r, n):
        return [r.standard_normal((1, h, n, 8), dtype=np.float32) for h in (4, 2, 2)]

    return Case(fn, draw, [2] * 3)


def nanochat_case(backend, examples):
    nanochat = examples["nanochat_attention"]
    rng = np.random.default_rng(11)
    _, *weights = nanochat.make_inputs(rng, B=1, T=1, C=24, n_head=6, n_kv_head=2)
    fn = ac.compile(nanochat.nanochat_attention, backend=backend, n_head=6, n_kv_head=2)
    return Case(fn, lambda r, n: [r.standard_normal((1, n, 24), dtype=np.float32)], [1], weights)


@pytest.fixture(scope="module")
def examples():
    return {name: load_example(name) for name in ("sinks_window", "gqa", "nanochat_attention")}


def serve(case: Case, seed: int, page_size: int = 8, num_pages: int = 256, steps: int = 14):
    """A random workload: prefill and decode steps, forks at random points, frees; checks every output."""
    rng = np.random.default_rng(seed)
    srv = case.fn.paged_decoder(page_size=page_size, num_pages=num_pages)
    srv.cascade_min = page_size  # so that short shared prompts are attended in cascade too
    history: dict[int, list[list[np.ndarray]]] = {}
    outputs: dict[int, list[np.ndarray]] = {}
    length: dict[int, int] = {}

    def check(seq):
        tokens = [np.concatenate([h[a] for h in history[seq]], axis=axis) for a, axis in enumerate(case.axes)]
        whole = case.fn(*tokens, *case.shared)
        got = np.concatenate(outputs[seq], axis=case.axes[0] if len(case.axes) > 1 else 1)
        assert got.shape == whole.shape
        assert np.max(np.abs(got - whole)) / np.max(np.abs(whole)) < RTOL, f"sequence {seq}"

    for _ in range(3):
        seq = srv.new()
        history[seq], outputs[seq], length[seq] = [], [], 0
    for _ in range(steps):
        live = list(history)
        batch = {}
        for seq in rng.permutation(live)[: rng.integers(1, len(live) + 1)]:
            seq = int(seq)
            n = int(rng.integers(1, 30 if length[seq] == 0 else 6))
            n = min(n, 100 - length[seq])
            if n > 0:
                batch[seq] = case.draw(rng, n)
        ys = srv.step({seq: (*tokens, *case.shared) for seq, tokens in batch.items()})
        for seq, tokens in batch.items():
            history[seq].append(tokens)
            outputs[seq].append(ys[seq])
            length[seq] += tokens[0].shape[case.axes[0]]
            assert srv.length(seq) == length[seq]
        if rng.random() < 0.5:  # fork a sequence: the child shares its history and its outputs so far
            parent = int(rng.choice([s for s in history if length[s] > 0]))
            child = srv.fork(parent)
            history[child], outputs[child] = list(history[parent]), list(outputs[parent])
            length[child] = length[parent]
        if len(history) > 3 and rng.random() < 0.3:
            gone = int(rng.choice(list(history)))
            check(gone)
            srv.free(gone)
            del history[gone], outputs[gone], length[gone]
    for seq in list(history):
        check(seq)
        srv.free(seq)
    assert srv.pages_free == num_pages  # every page back once every sequence is freed
    return srv


@pytest.mark.parametrize("seed,page_size", [(0, 8), (1, 24)])  # 24: key tiles begin and end inside pages
def test_alibi_window_sequences_on_cpu(seed, page_size):
    srv = serve(alibi_case("cpu"), seed, page_size)
    assert srv.cascades > 0


@pytest.mark.parametrize("name", ["alibi", "sinks", "gqa", "nanochat"])
def test_sequences_in_the_interpreter(examples, name):
    case = alibi_case("interp") if name == "alibi" else globals()[f"{name}_case"]("interp", examples)
    serve(case, seed=2)


def test_nanochat_layer_on_cpu(examples):
    serve(nanochat_case("cpu", examples), seed=3, steps=8)


def prompt(srv, rng, n=21):
    seq = srv.new()
    srv.step({seq: (*(rng.standard_normal((1, 2, n, 8), dtype=np.float32) for _ in range(3)), SLOPES)})
    return seq


SLOPES = np.array([0.5, 0.25], np.float32)


def tokens(rng, n=1, heads=2):
    return (*(rng.standard_normal((1, heads, n, 8), dtype=np.float32) for _ in range(3)), SLOPES)


def test_fork_copies_at_most_one_page():
    rng = np.random.default_rng(4)
    srv = ac.compile(specs.causal_alibi, backend="interp", window=19).paged_decoder(page_size=8, num_pages=16)
    a = prompt(srv, rng, n=21)  # pages of 8, 8 and 5 positions
    assert srv.pages_free == 13
    b = srv.fork(a)
    assert srv.pages_free == 13 and srv.length(b) == 21  # sharing, nothing copied yet
    srv.step({b: tokens(rng)})
    assert srv.pages_free == 12  # b's partial last page was copied on write: one page
    srv.step({a: tokens(rng, 3)})
    assert srv.pages_free == 12  # a holds its last page alone again: written in place
    c = srv.fork(a)
    srv.step({c: tokens(rng, 2)})  # a's 24 positions fill 3 pages: shared as they are, c takes one new page
    assert srv.pages_free == 11
    for seq in (a, b, c):
        srv.free(seq)
    assert srv.pages_free == 16


def snapshot(srv):
    pool = srv.pool
    return (
        [a.tobytes() for a in pool.host_arrays()],
        pool.refs.tobytes(),
        {s: (list(q.pages), q.length) for s, q in pool.sequences.items()},
        pool.pages_free,
    )


def test_a_failed_step_changes_nothing():
    rng = np.random.default_rng(5)
    srv = ac.compile(specs.causal_alibi, backend="interp", window=19).paged_decoder(page_size=8, num_pages=6)
    a = prompt(srv, rng, n=21)
    b = srv.fork(a)
    gone = srv.fork(a)
    srv.free(gone)
    before = snapshot(srv)
    bad = [
        ({a: tokens(rng), b: tokens(rng, 30)}, PoolExhausted, r"needs 5 pages, 3 are free \(of 6\)"),
        ({a: tokens(rng), gone: tokens(rng)}, KeyError, "unknown or freed sequence"),
        ({a: tokens(rng), 99: tokens(rng)}, KeyError, "unknown or freed sequence 99"),
        ({a: tokens(rng), b: tokens(rng, heads=3)}, ac.ShapeError, "slopes: dimension H is 2"),
        (
            {a: tokens(rng), b: (*(np.zeros((2, 2, 1, 8), np.float32) for _ in range(3)), SLOPES)},
            ac.ShapeError,
            "each sequence brings batch size 1, got 2",
        ),
        ({a: tokens(rng)[:3]}, TypeError, "takes 4 arguments"),
    ]
    for batch, error, message in bad:
        with pytest.raises(error, match=message):
            srv.step(batch)
        assert snapshot(srv) == before


def test_a_step_that_fails_after_its_append_takes_it_back(monkeypatch):
    """The step appends its new rows before it attends (the attention reads them in place): a failure
    after that gives back the pages it took, copied on write or new, and every length and table."""
    rng = np.random.default_rng(9)
    fn = ac.compile(specs.causal_alibi, backend="interp", window=19)
    srv, twin = (fn.paged_decoder(page_size=8, num_pages=12) for _ in range(2))
    for pool in (srv, twin):
        a = prompt(pool, np.random.default_rng(1), n=24)  # three whole pages: its next token takes a new one
        b = prompt(pool, np.random.default_rng(2), n=21)  # a partial last page, shared with its fork:
        c = pool.fork(b)  # the next token of each copies it on write
    batch = {a: tokens(rng), b: tokens(rng, 3), c: tokens(rng)}
    state = snapshot(srv)[1:]  # the reference counts, the tables and lengths, the free pages

    def fails(*args, **kwargs):
        raise RuntimeError("the attention failed")

    with monkeypatch.context() as patched:
        patched.setattr(srv.paged.fn, "run_shaped", fails)
        with pytest.raises(RuntimeError, match="the attention failed"):
            srv.step(batch)
    assert snapshot(srv)[1:] == state
    got, want = srv.step(batch), twin.step(batch)  # as if the failed step had never been
    for seq in batch:
        np.testing.assert_array_equal(got[seq], want[seq])
    assert snapshot(srv) == snapshot(twin)


def test_an_append_that_fails_takes_itself_back(monkeypatch):
    """A write that fails partway (the second page array's: a device's error) leaves the pool as it was."""
    rng = np.random.default_rng(10)
    srv = ac.compile(specs.causal_alibi, backend="interp", window=19).paged_decoder(page_size=8, num_pages=12)
    b = prompt(srv, rng, n=21)
    c = srv.fork(b)  # its next token copies b's partial last page on write
    state = snapshot(srv)[1:]
    written = []

    def write(array, pages, slots, rows):
        written.append(array)
        if len(written) == 2:
            raise RuntimeError("the write failed")

    monkeypatch.setattr(srv.pool.storage, "write", write)
    with pytest.raises(RuntimeError, match="the write failed"):
        srv.step({b: tokens(rng, 4), c: tokens(rng)})
    assert snapshot(srv)[1:] == state


def test_specs_a_decoder_cannot_serve_are_refused():
    with pytest.raises(ac.PipelineError, match="kv-cache-reuse: not applied"):
        ac.compile(specs.document, backend="interp").paged_decoder()


def test_the_serving_example_decodes_users_sharing_a_prompt():
    example = load_example("serve_shared_prompt")
    report = example.serve(backend="cpu", users=3, prompt=70, turn=5, steps=4)
    assert report["error"] < RTOL
    assert report["cascades"] == 5  # the users' turns and every decode step read the prompt once
    assert report["pool_bytes"] < report["contiguous_bytes"]


def test_the_cpu_kernel_reads_pages_in_place_and_checks_their_numbers_first():
    rng = np.random.default_rng(6)
    srv = ac.compile(specs.causal_alibi, backend="cpu", window=19).paged_decoder(page_size=8, num_pages=16)
    a = prompt(srv, rng, n=21)
    kernel = srv.paged.fn.source.split("def run(")[0]
    assert "k_staged[c, e] = " in kernel  # key tiles gathered through the table, not a copied sequence
    # a few query rows (decoding) read each page's run of rows in place: no gathered copy
    run = "arg_6[page, bi_1, slot:slot + run], sg, sg_spare, G, nq, run, 0, c0)"  # the scores from row c0 of sg
    assert f"group_scores(qt, qt_bits, qt_is_bf16, {run}" in kernel
    values = "group_values(sg, arg_7[page, v_at_1, slot:slot + run], acc, active, row_ids, G, nq, run, 0, c0, False)"
    assert values in kernel  # False: the output is float32
    q, _, _, slopes = tokens(rng)
    sizes = {"B_start": 0, "H_start": 0, "q_start": 0, "k_start": 0, "H": 2, "D": 8, "E": 8, "T": 1, "S": 22}
    keys, values = srv.pool.arrays
    table = np.array([srv.pool.sequence(a).pages], np.int64)
    ragged = [np.array([[21]]), np.array([0]), np.array([21])]  # position of the query, first key, key count
    got = srv.paged.fn.run([q, keys, values, table, *ragged, slopes], dict(sizes, k_rows=21))
    want = srv.plan.ragged_attention().fn.run([q, *srv.pool.read(a, 0, 21), *ragged, slopes], sizes)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-6)
    with pytest.raises(IndexError, match="page 99 is out of range for a pool of 16 pages"):
        bad = np.array([[0, 99, 2]], np.int64)
        srv.paged.fn.run([q, keys, values, bad, *ragged, slopes], dict(sizes, k_rows=21))
