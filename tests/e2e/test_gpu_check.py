"""``python -m benchmarks.gpu_check``: its dry run end to end (every phase under the simulator, at tiny
sizes), and the pieces its summary is made of."""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.gpu_check import cards, phases, plan, processes, summary
from benchmarks.gpu_check.environment import compile_reason, minimum_versions, version_tuple
from benchmarks.gpu_check.outcomes import read_outcomes
from benchmarks.gpu_check.run import Phase, Run

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(importlib.util.find_spec("numba_cuda") is None, reason="the cuda extra (numba-cuda) is absent")
@pytest.mark.long
def test_the_dry_run_writes_its_summary_and_logs(tmp_path):
    out = tmp_path / "check"
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_ENABLE_CUDASIM", "ATTNCOMP_TEST_GPU")}
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", "--dry-run", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    elapsed = time.monotonic() - started
    assert done.returncode == 0, done.stdout + done.stderr
    files = sorted(p.name for p in out.iterdir())
    assert set(files) <= set(plan.FILES) and len(files) <= 8, files
    assert all((out / name).stat().st_size < plan.MAX_FILE_BYTES for name in files)
    lines = (out / "summary.md").read_text().splitlines()
    assert lines[0] == "# gpu_check: DRY RUN PASSED"
    assert lines[2].startswith("card: none (dry run")
    phases = {line[2:].split(":")[0]: line.split(": ", 1)[1] for line in lines[4:10]}
    assert list(phases) == list(plan.PHASES)
    for name, state in [
        ("environment", "passed"),
        ("gate", "passed"),
        ("correctness", "passed"),
        ("compile", "passed"),
        ("timings", "skipped"),
        ("sanitizer", "skipped"),
    ]:
        assert phases[name].startswith(f"{state}, "), (name, phases[name])
    assert "dry run" in phases["timings"] and "dry run: 3 selected tests" in phases["correctness"]
    # the layout tests (mma in f16, bf16 and tf32, quads and packing, the tf32 split, rounding): all run
    assert re.match(r"passed, \d+ s: \d+ passed, \d+ deselected \(gate.log\)$", phases["gate"]), phases["gate"]
    ran = read_outcomes(out / "correctness.tsv")
    assert sorted(ran) == sorted(plan.DRY_RUN_CORRECTNESS) and set(ran.values()) == {"passed"}, ran
    slowest = lines.index(next(line for line in lines if line.startswith("Slowest in the correctness phase")))
    listed = lines[slowest + 2 : slowest + 2 + len(ran)]
    assert sorted(re.sub(r"^- [\d.]+ s `(.*)`$", r"\1", line) for line in listed) == sorted(ran), listed
    assert "compiled:" in (out / "compile.log").read_text()
    (total,) = [int(m) for line in lines for m in re.findall(r"^Total (\d+) s of a 480 s deadline", line)]
    assert total >= sum(int(re.match(r"\w+, (\d+) s", state).group(1)) for state in phases.values()) - len(phases)
    assert elapsed < 240, f"the dry run took {elapsed:.0f} s"


@pytest.mark.parametrize(
    "device,card",
    [
        ("NVIDIA H100 80GB HBM3", "H100 SXM"),
        ("NVIDIA H100 PCIe", "H100 PCIe"),
        ("NVIDIA H200", "H200"),
        ("NVIDIA A100-SXM4-80GB", "A100 SXM 80GB"),
        ("NVIDIA A100-SXM4-40GB", "A100 SXM 40GB"),
        ("NVIDIA A100 80GB PCIe", "A100 PCIe 80GB"),
        ("NVIDIA H100 NVL", None),
        ("NVIDIA GeForce RTX 4090", None),
        (None, None),
    ],
)
def test_known_cards_by_device_name(device, card):
    found = cards.card_for(device)
    assert (found.name if found else None) == card


def test_a_row_is_held_against_the_peak_of_its_products():
    h100 = cards.card_for("NVIDIA H100 80GB HBM3")
    assert h100.tflops_peak("bfloat16", None) == h100.half
    assert h100.tflops_peak("float32", "exact") == h100.tf32 == h100.tflops_peak("float32", "tf32")
    assert h100.tflops_peak("float32", "ieee") == h100.f32


def test_table_lines_compute_rates_from_a_record():
    """A synthetic record (not a measurement): 1 ms for 10^12 operations and 10^9 bytes."""
    card = cards.Card("test card", half=2000.0, tf32=1000.0, f32=100.0, bandwidth=4000.0)
    record = {
        "kind": "row",
        "name": "row",
        "dtype": "bfloat16",
        "precision": None,
        "ms": 1.0,
        "flops": 1e12,
        "bytes": 1e9,
        "peer": "flash",
        "peer_ms": 2.0,
        "ratio": 0.5,
        "default": "cudnn",
        "default_ms": 1.0,
        "default_ratio": 1.0,
    }
    (line,) = [line for line in summary.table_lines("t", [record], card) if line.startswith("| row |")]
    assert line.split(" | ")[1:6] == ["1.000", "1000.0", "50%", "1000", "25%"]
    unknown = [line for line in summary.table_lines("t", [record], None) if line.startswith("| row |")]
    assert unknown[0].split(" | ")[3] == "n/a"


def test_the_decoder_table_keeps_its_lines_and_where_their_time_goes():
    """Synthetic records (not measurements) of the decoder table: rows, a profile line each, an error."""
    records = [
        {"kind": "line", "text": "decoder step: 1.000 ms"},
        {"kind": "profile", "text": "float32 decoder step: 2 launches a call, issue 40 us, span 900 us: ..."},
        {"kind": "error", "name": "bf16 decode step", "error": "AssertionError: differs"},
    ]
    run = argparse.Namespace(
        phases={
            "timings": argparse.Namespace(
                status="failed", data={"tables": {"decoder": {"status": "failed", "records": records}}}
            )
        }
    )
    lines = summary.timing_lines(run, None)
    at = lines.index("decoder step: 1.000 ms")
    assert lines[at + 1 : at + 3] == [
        "  float32 decoder step: 2 launches a call, issue 40 us, span 900 us: ...",
        "error: AssertionError: differs",
    ]


def test_minimum_versions_come_from_pyproject():
    minimum = minimum_versions()
    assert {"numba", "numba-cuda", "torch", "transformers", "ml-dtypes"} <= set(minimum)
    assert version_tuple("2.13.0+cpu") == (2, 13, 0)
    assert version_tuple("0.30.4") >= version_tuple(minimum["numba-cuda"])


def test_pytest_counts_from_a_summary_or_from_verbose_lines(tmp_path):
    log = tmp_path / "log"
    log.write_text("x\n====== 3 passed, 1 failed, 2 skipped, 5 deselected in 3.2s ======\n")
    assert phases.pytest_counts(log) == {"passed": 3, "failed": 1, "skipped": 2, "deselected": 5}
    log.write_text(
        "[gw0] [ 10%] PASSED tests/a.py::t1\n[gw1] [ 20%] FAILED tests/a.py::t2\ntests/b.py::t3 PASSED\n"
        "FAILED tests/a.py::t2 - AssertionError: 2 failed\n"  # a failure's message is no summary
    )
    assert phases.pytest_counts(log) == {"passed": 2, "failed": 1}


OUTCOME_TESTS = """
import pytest

def test_passes():
    pass

def test_fails():
    assert 1 == 2, "a planted failure"

def test_skips():
    pytest.skip("planted")
"""


def test_outcomes_are_written_as_tests_finish_and_a_second_run_leaves_them_out(tmp_path):
    """Each outcome is a line of correctness.tsv as its test ends, and a failure's report is in the log
    before pytest's closing summary (which a phase killed at its limit never prints); ``--after``'s
    file leaves out what it lists."""
    (tmp_path / "test_planted.py").write_text(OUTCOME_TESTS)
    tsv = tmp_path / "outcomes.tsv"
    env = {**os.environ, "GPU_CHECK_OUTCOMES": str(tsv), "PYTHONPATH": str(ROOT)}
    env.pop("GPU_CHECK_DONE", None)
    command = [sys.executable, "-m", "pytest", "-p", "benchmarks.gpu_check.outcomes", "-p", "no:cacheprovider"]
    command += ["-o", "addopts=", "-q", "--rootdir", str(tmp_path), str(tmp_path / "test_planted.py")]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    ran = read_outcomes(tsv)
    assert {node.split("::")[1]: outcome for node, outcome in ran.items()} == {
        "test_passes": "passed",
        "test_fails": "failed",
        "test_skips": "skipped",
    }
    report = done.stdout.index("FAILED test_planted.py::test_fails (call)")
    assert "a planted failure" in done.stdout[report:] and report < done.stdout.index("short test summary")
    (tmp_path / "test_planted.py").write_text(OUTCOME_TESTS + "\ndef test_new():\n    pass\n")
    again = subprocess.run(
        command,
        env={**env, "GPU_CHECK_DONE": str(tsv), "GPU_CHECK_OUTCOMES": str(tmp_path / "rest.tsv")},
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert again.returncode == 0 and "1 passed, 3 deselected" in again.stdout, again.stdout
    assert list(read_outcomes(tmp_path / "rest.tsv")) == ["test_planted.py::test_new"]


@pytest.mark.skipif(importlib.util.find_spec("numba_cuda") is None, reason="the cuda extra (numba-cuda) is absent")
def test_an_installation_that_cannot_compile_is_named_with_its_fix(monkeypatch):
    """numba-cuda 0.30.4 with numpy 2.5 fails on its first compile (numpy.row_stack is gone): the
    environment phase says so and how to mend it, instead of every later test failing alike."""
    from numba import cuda

    def broken(*args, **kwargs):
        raise AttributeError("module 'numpy' has no attribute 'row_stack'")

    monkeypatch.setattr(cuda, "compile_ptx", broken)
    reason = compile_reason()
    assert reason.startswith("Numba-CUDA cannot compile a kernel (AttributeError") and "numpy < 2.5" in reason


def test_long_logs_keep_their_head_and_tail(tmp_path):
    log = tmp_path / "log"
    log.write_bytes(b"head" + b"x" * 3_000_000 + b"tail")
    processes.cap_file(log, limit=2**21)
    data = log.read_bytes()
    assert data.startswith(b"head") and data.endswith(b"tail") and len(data) < 2**21 + 100 and b"cut" in data


def test_the_default_limits_fit_the_deadline_and_correctness_has_the_most():
    """Every phase at its limit still ends 10 s before the deadline (starting and stopping processes)."""
    assert sum(plan.LIMITS.values()) + plan.RESERVE <= plan.DEADLINE - 10
    assert max(plan.LIMITS, key=plan.LIMITS.get) == "correctness"


def test_a_late_run_shortens_every_phase_still_to_come(tmp_path):
    args = argparse.Namespace(
        out_dir=str(tmp_path), deadline=plan.DEADLINE, jobs=1, dry_run=False, limits={}, phases=list(plan.PHASES)
    )
    run = Run(args)
    shutil.rmtree(run.scratch)
    limits = plan.LIMITS
    assert [run.limit(name) for name in plan.PHASES] == [limits[name] for name in plan.PHASES]
    rest = sum(limits[name] for name in plan.PHASES[1:])
    run.deadline = time.monotonic() + plan.RESERVE + rest / 2  # the environment took half the time
    assert run.limit("gate") == pytest.approx(limits["gate"] / 2, rel=0.01)
    correctness = rest / 2 * limits["correctness"] / (rest - limits["gate"])
    assert run.limit("correctness") == pytest.approx(correctness, rel=0.01)
    assert run.limit("sanitizer") == limits["sanitizer"]
    run.deadline = time.monotonic()
    assert run.limit("sanitizer") == 0


def test_a_table_is_skipped_where_less_than_its_least_time_is_left(tmp_path, monkeypatch):
    """The timings' tables share what is left, in order; the flex table (which compiles PyTorch's
    FlexAttention in its process) runs where the tables before it left it its least time, and is
    skipped, not started to be cut short, where they took their whole shares."""
    args = argparse.Namespace(
        out_dir=str(tmp_path), deadline=plan.DEADLINE, jobs=1, dry_run=False, limits={}, phases=list(plan.PHASES)
    )
    args.quick, args.repeats = False, 1
    run = Run(args)
    clock, taken, started = [0.0], [0.0], {}

    def run_logged(command, log, env, budget, label):
        started[label] = budget
        clock[0] += budget * taken[0]  # each table takes this fraction of its share
        return 0

    monkeypatch.setattr(phases, "run_logged", run_logged)
    monkeypatch.setattr(phases.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(phases, "read_records", lambda path: [{"kind": "line", "text": "a row"}])
    monkeypatch.setattr(phases, "gate_failed", lambda run: False)
    monkeypatch.setattr(run, "limit", lambda phase: plan.LIMITS["timings"])
    for fraction, flex_runs in ((0.2, True), (1.0, False)):
        taken[0] = fraction
        started.clear()
        phase = Phase("timings")
        phases.phase_timings(run, phase)
        assert set(started) == set(plan.TABLES) - (set() if flex_runs else {"flex"})
        assert phase.data["tables"]["flex"]["status"] == ("passed" if flex_runs else "skipped")
        assert all(started.get(t, 40.0) >= plan.MIN_TABLE_SECONDS.get(t, 5.0) for t in plan.TABLES)
    shutil.rmtree(run.scratch)


def gone(pid: int) -> bool:
    """Whether a process has ended (a zombie waiting for its reaper counts as ended)."""
    for _ in range(50):
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state == "Z":
            return True
        time.sleep(0.1)
    return False


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc")
def test_a_process_out_of_time_is_killed_with_its_children(tmp_path):
    """The process ends on the interrupt; its child ignores it, and is killed all the same."""
    pid_file = tmp_path / "child.pid"
    child = "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); time.sleep(60)"
    parent = (
        "import subprocess, sys, time\n"
        f"child = subprocess.Popen([sys.executable, '-c', {child!r}])\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "time.sleep(60)\n"
    )
    started = time.monotonic()
    with open(tmp_path / "log", "w") as log:
        process = processes.spawn([sys.executable, "-c", parent], log, dict(os.environ))
        assert processes.finish(process, timeout=3, grace=1) is None
    assert time.monotonic() - started < 3 + 1 + plan.KILL_WAIT
    assert process.returncode is not None
    assert gone(int(pid_file.read_text())), (tmp_path / "log").read_text()
