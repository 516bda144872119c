"""Context parallelism on gloo: 2 and 4 processes against the single-process call (docs/distributed.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import attncomp as ac
from tests.context_parallel.cases import CASES, build, spec_of

#: one worker runs them all: the processes behind ``runs`` start once
pytestmark = pytest.mark.xdist_group("context_parallel")

torch = pytest.importorskip("torch")
if not torch.distributed.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

import attncomp.distributed as acd  # noqa: E402
from attncomp.distributed.layout import Layout  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NUMERIC = [c for c in CASES]
ERRORS = ["error-length", "error-heads", "error-timeout"]
#: the cases also run on 4 processes
FOUR = ["causal", "documents", "alibi", "window"]


def launch(world: int, cases: list[str], out: str) -> None:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), ATTNCOMP_QUIET="1")
    command = [sys.executable, "-m", "tests.context_parallel.cp_worker", "--world", str(world), "--out", out]
    done = subprocess.run(
        [*command, "--cases", ",".join(cases)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The worker's files: 2 processes for every case, 4 for a few."""
    out = {}
    for world, cases in ((2, NUMERIC + ERRORS), (4, FOUR)):
        folder = str(tmp_path_factory.mktemp(f"cp{world}"))
        launch(world, cases, folder)
        out[world] = folder
    return out


def gathered(folder: str, name: str, world: int) -> tuple[dict, Layout]:
    ranks = [dict(np.load(os.path.join(folder, f"{name}-{r}.npz"))) for r in range(world)]
    owner = tuple(int(o) for o in ranks[0]["owner"])
    chunk = int(ranks[0]["chunk"])
    layout = Layout(world, chunk * len(owner), chunk, owner, (1.0,) * len(owner))
    return {"ranks": ranks}, layout


@pytest.mark.parametrize("world, name", [(2, c) for c in NUMERIC] + [(4, c) for c in FOUR])
def test_outputs_and_gradients_match_one_process(runs, world, name):
    case = CASES[name]
    found, layout = gathered(runs[world], name, world)
    ranks = found["ranks"]
    _, args, cotangent = build(case, world)
    bf16 = case.get("dtype") == "bf16"
    if bf16:  # the reference sees the rounded inputs the ranks had
        import ml_dtypes

        args = [a.astype(ml_dtypes.bfloat16).astype(np.float32) if a.ndim == 4 else a for a in args]
    # the float64 interpreter's outputs and gradients
    reference = ac.compile(spec_of(case), backend="interp", **case.get("constants", {}))
    reference = reference if not bf16 else reference.for_dtype("f32")
    out, pullback = reference.vjp(*args)
    tolerance = 3e-2 if bf16 else 2e-5
    if "max" in ranks[0]:  # each row's max score, merged across the ring's chunk pairs: no gradient
        out, top = out
        grads = pullback(cotangent, None)
        got_top = layout.unshard([r["max"] for r in ranks], -1)
        bound = 4e-3 if bf16 else 1e-5  # bf16: the spec's result type rounds it
        assert np.max(np.abs(got_top - top)) <= bound * max(1.0, np.max(np.abs(top)))
    else:
        grads = pullback(cotangent)
    got = layout.unshard([r["out"] for r in ranks])
    assert np.max(np.abs(got - out)) <= tolerance * max(1.0, np.max(np.abs(out)))
    for k, (g, sharded) in enumerate(zip(grads, case["sharded"])):
        if g is None:
            assert f"grad{k}" not in ranks[0]
            continue
        if sharded is None:  # a shared tensor: every rank holds the whole sum
            pieces = [r[f"grad{k}"] for r in ranks]
            for piece in pieces:
                assert np.max(np.abs(piece - g)) <= tolerance * max(1.0, np.max(np.abs(g))), f"gradient {k}"
        else:
            whole = layout.unshard([r[f"grad{k}"] for r in ranks], sharded)
            assert np.max(np.abs(whole - g)) <= tolerance * max(1.0, np.max(np.abs(g))), f"gradient {k}"


def test_causal_is_dealt_as_a_zigzag_and_skips_masked_pairs(runs):
    found, layout = gathered(runs[2], "causal", 2)
    assert layout.owner == (0, 1, 1, 0)  # chunk c with chunk 3 - c
    # rank 0 (chunks 0, 3) and rank 1 (chunks 1, 2) each compute 5 of the 16 pairs' live ones (10)
    assert [int(r["pairs"]) for r in found["ranks"]] == [5, 5]
    assert int(found["ranks"][0]["steps"]) == 1


def test_window_keeps_the_contiguous_split_and_one_ring_step(runs):
    """On 4 ranks a dealt window would send keys 3 steps around the ring; contiguous ranks need
    only their left neighbour's."""
    found, layout = gathered(runs[4], "window", 4)
    assert layout.owner == tuple(sorted(layout.owner))
    assert [int(r["steps"]) for r in found["ranks"]] == [1] * 4


@pytest.mark.parametrize(
    "name, says", [("error-length", "k: this rank's shard has 31"), ("error-heads", "disagree on")]
)
def test_bad_shards_raise_the_same_error_on_every_rank(runs, name, says):
    messages = [json.load(open(os.path.join(runs[2], f"{name}-{r}.json")))["message"] for r in range(2)]
    assert all(says in m for m in messages), messages
    assert messages[0] == messages[1]


def test_a_missing_peer_times_out_instead_of_hanging(runs):
    record = json.load(open(os.path.join(runs[2], "error-timeout-0.json")))
    assert "CollectiveTimeout" in record["message"] and "did not complete within 3 s" in record["message"]
    assert record["seconds"] < 30


def test_specs_that_compute_projections_are_refused_before_any_collective():
    import attncomp as ac
    from tests.context_parallel.cases import projected

    fn = ac.compile(projected, backend="cpu")
    with pytest.raises(ValueError, match="computes q"):
        acd.context_parallel(fn, Layout.contiguous(2, 64))


def test_balance_reaches_its_targets_on_long_sequences():
    import attncomp as ac
    from examples.causal import causal

    fn = ac.compile(causal, backend="interp")
    q = np.broadcast_to(np.zeros((), np.float32), (1, 1, 65536, 64))
    layout = acd.balance(fn, 8, q, q, q)
    assert layout.imbalance <= 1.05
    assert Layout.contiguous(8, 65536).owner != layout.owner


def test_layout_shards_and_unshards_numpy_and_torch():
    layout = Layout(2, 8, 2, (0, 1, 1, 0), (1.0,) * 4)
    x = np.arange(2 * 8).reshape(2, 8)
    shards = [layout.shard(x, r, -1) for r in range(2)]
    assert shards[0].tolist() == [[0, 1, 6, 7], [8, 9, 14, 15]]
    assert np.array_equal(layout.unshard(shards, -1), x)
    t = torch.arange(16).reshape(8, 2)
    assert torch.equal(layout.unshard([layout.shard(t, r, 0) for r in range(2)], 0), t)
    with pytest.raises(ValueError, match="shards\\[1\\]: expected 4 positions"):
        layout.unshard([shards[0], shards[1][:, :3]], -1)
    with pytest.raises(ValueError, match="same number of chunks"):
        Layout(2, 8, 2, (0, 0, 0, 1), (1.0,) * 4)


def test_specs_that_mix_positions_are_refused_by_name():
    import attncomp as ac
    from tests.context_parallel.cases import centred_keys

    fn = ac.compile(centred_keys, backend="cpu")
    with pytest.raises(ac.PipelineError, match=r"ac\.reduce .* reduces over the axis T"):
        acd.context_parallel(fn, Layout.contiguous(2, 64))


def test_importing_attncomp_distributed_does_not_import_torch():
    code = "import sys, attncomp.distributed; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_a_tiny_model_trains_on_two_ranks_as_in_one_process():
    """examples/context_parallel.py under torchrun: the sharded losses follow the one-process ones."""
    env = dict(os.environ, ATTNCOMP_QUIET="1", OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command += ["examples/context_parallel.py", "--steps", "3", "--check", "1e-4"]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [line.split() for line in done.stdout.splitlines()]
    rows = [row for row in rows if len(row) == 3 and row[0].isdigit()]  # step, sharded loss, one process's
    assert len(rows) == 3
    assert "largest relative difference" in done.stdout
