"""The phases: each runner starts its subprocesses under the phase's limit and records what they did;
``run_phases`` runs them in order."""

from __future__ import annotations

import re
import signal
import sys
import time
from pathlib import Path

from benchmarks.gpu_check.environment import find_sanitizer
from benchmarks.gpu_check.outcomes import read_outcomes, read_seconds
from benchmarks.gpu_check.plan import (
    CORRECTNESS,
    DRY_RUN_CORRECTNESS,
    GATE_FILES,
    GATE_KEYWORDS,
    MIN_TABLE_SECONDS,
    NEEDED,
    PER_TEST_SECONDS,
    PHASES,
    SLOWEST_LISTED,
    TABLES,
)
from benchmarks.gpu_check.processes import finish, read_records, run_logged, signal_group, spawn
from benchmarks.gpu_check.run import Phase, Run


def phase_environment(run: Run, phase: Phase) -> None:
    result = run.scratch / "environment.json"
    status = run_logged(
        run.worker("environment", result), run.out / "environment.log", run.env(), run.limit("environment"), "env"
    )
    records = read_records(result)
    if status is None:
        phase.status, phase.note = "timed out", "the environment's probes did not answer in time"
        return
    if not records:
        phase.status, phase.note = "failed", f"the probe exited {status} without a report (environment.log)"
        return
    info = records[-1]
    phase.data = info
    missing = info.get("missing", [])
    old = info.get("too_old", [])
    notes = []
    if missing:
        notes.append(f"missing: {', '.join(missing)}")
    if old:
        notes.append(f"older than pyproject.toml asks: {', '.join(old)}")
    if not run.args.dry_run and info.get("gpu_reason"):
        notes.append(f"no usable GPU: {info['gpu_reason']}")
    if info.get("compile_reason"):
        notes.append(info["compile_reason"])
    phase.status = "failed" if any(m in NEEDED for m in missing) or info.get("compile_reason") else "passed"
    phase.note = "; ".join(notes) or "every package present"


# the pytest phases -----------------------------------------------------------------------------
def pytest_command(run: Run, targets: list[str], jobs: int | None, extra: list[str]) -> tuple[list[str], list[str]]:
    """A pytest command line (no cache, the project's ``-n auto`` replaced), and notes on what it lacks."""
    import importlib.util

    notes = []
    # -v: every test's outcome is in the log as it finishes, also when a phase is cut short
    command = [sys.executable, "-m", "pytest", *targets, "-v", "-p", "no:cacheprovider", "-o", "addopts=", "-rfE"]
    if jobs is not None:
        if importlib.util.find_spec("xdist") is not None:
            command += ["-n", str(jobs)]
        else:
            notes.append("pytest-xdist is not installed: one process")
    command += ["-o", f"faulthandler_timeout={PER_TEST_SECONDS}"]
    if importlib.util.find_spec("pytest_timeout") is not None:
        command += [f"--timeout={PER_TEST_SECONDS}"]
    else:
        notes.append(
            f"per-test timeouts need pytest-timeout (absent): a test past {PER_TEST_SECONDS} s has its stack "
            "dumped (faulthandler_timeout), and the phase's limit stops it"
        )
    return command + extra, notes


def pytest_counts(log_path: Path) -> dict[str, int]:
    """The counts of pytest's last summary line in a log (passed, failed, skipped, errors, ...); where
    there is none (a run cut short), the outcomes its verbose lines report so far."""
    text = log_path.read_text(errors="replace") if log_path.exists() else ""
    final = r"\d+ (passed|failed|skipped|error).* in [\d.]+s\b"  # "3 passed, 1 skipped in 2.31s"
    lines = [line for line in text.splitlines() if re.search(final, line)]
    counts: dict[str, int] = {}
    if lines:
        for number, word in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|xpassed)", lines[-1]):
            counts["errors" if word.startswith("error") else word] = int(number)
        return counts
    outcome = r"(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)"
    for line in text.splitlines():  # "[gw3] [ 12%] PASSED tests/...", or "tests/...::name PASSED [ 12%]"
        found = re.match(rf"\[gw\d+\] \[\s*\d+%\] {outcome} ", line) or re.search(rf"::\S+ {outcome}(?: |$)", line)
        if found:
            word = {"ERROR": "errors", "XFAIL": "xfailed", "XPASS": "xpassed"}.get(
                found.group(1), found.group(1).lower()
            )
            counts[word] = counts.get(word, 0) + 1
    return counts


def judge_pytest(phase: Phase, status: int | None, counts: dict[str, int], log: str) -> None:
    summary = ", ".join(f"{n} {w}" for w, n in counts.items()) or "no pytest summary"
    if status is None:
        phase.status = "timed out"
    elif status == 0 and counts.get("passed", 0) > 0:
        phase.status = "passed"
    elif status == 0:
        phase.status = "skipped"  # every test skipped: the reasons are in the log
    else:
        phase.status = "failed"
    phase.note = f"{summary} ({log})"
    phase.data = {"counts": counts, "exit": status}


def pytest_available(run: Run, phase: Phase) -> bool:
    import importlib.util

    if importlib.util.find_spec("pytest") is None:
        phase.status, phase.note = "skipped", "pytest is not installed"
        return False
    return True


def phase_gate(run: Run, phase: Phase) -> None:
    if not pytest_available(run, phase):
        return
    command, notes = pytest_command(run, list(GATE_FILES), None, ["-k", GATE_KEYWORDS])
    log = run.out / "gate.log"
    status = run_logged(command, log, run.env(gpu_tests=True), run.limit("gate"), "gate", grace=10)
    judge_pytest(phase, status, pytest_counts(log), "gate.log")
    if phase.status == "passed" and phase.data["counts"].get("skipped"):
        phase.status, phase.note = "failed", phase.note + "; some layout tests skipped"


def outcome_env(run: Run, outcomes: Path) -> dict[str, str]:
    """A pytest phase's environment: the GPU tests asked for, and ``outcomes.py``'s files."""
    env = run.env(gpu_tests=True)
    env["GPU_CHECK_OUTCOMES"] = str(outcomes)
    env.pop("GPU_CHECK_DONE", None)
    if run.args.after:
        env["GPU_CHECK_DONE"] = str(Path(run.args.after).resolve())
    return env


def phase_correctness(run: Run, phase: Phase) -> None:
    if not pytest_available(run, phase):
        return
    targets = list(DRY_RUN_CORRECTNESS if run.args.dry_run else CORRECTNESS)
    outcomes = run.out / "correctness.tsv"
    jobs = 1 if run.args.dry_run else run.jobs  # a handful of tests: one worker
    command, notes = pytest_command(run, targets, jobs, ["-p", "benchmarks.gpu_check.outcomes"])
    log = run.out / "correctness.log"
    env = outcome_env(run, outcomes)
    status = run_logged(command, log, env, run.limit("correctness"), "correctness", grace=10)
    judge_pytest(phase, status, pytest_counts(log), "correctness.log, correctness.tsv")
    found = read_outcomes(outcomes) if outcomes.exists() else {}
    phase.data["failed"] = sorted(node for node, outcome in found.items() if outcome in ("failed", "error"))
    seconds = read_seconds(outcomes) if outcomes.exists() else {}
    phase.data["seconds"] = sum(seconds.values())
    phase.data["slowest"] = sorted(seconds.items(), key=lambda item: -item[1])[:SLOWEST_LISTED]
    if run.args.after:
        notes.insert(0, f"the tests that {Path(run.args.after).name} lists as run were left out (--after)")
    if status is None:
        notes.append("rerun the rest with --after OUT_DIR/correctness.tsv")
    if run.args.dry_run:
        notes.insert(0, f"dry run: {len(targets)} selected tests of the simulator's")
    phase.note = "; ".join([phase.note, *notes])


# the benchmark phases --------------------------------------------------------------------------
def gate_failed(run: Run) -> bool:
    """Whether the gate ran and did not pass (a gate not asked for leaves the timings to run)."""
    return run.phases["gate"].status in ("failed", "timed out")


def compile_jobs(run: Run) -> list[str]:
    """The compile phase's jobs: the sanitizer's workload first (its backward's compile alone took a
    minute under compute-sanitizer on an H100), then each benchmark row at its size (``tensor_cores:N``,
    ``training:N``), the decoder step, the serving rows, the flash_attn and the flex rows; in a dry run, one row of
    each table and the decoder, tiny."""
    if run.args.dry_run:
        return ["tensor_cores:0", "training:0", "decoder"]
    from benchmarks import tensor_core_training, tensor_cores

    jobs = ["sanitize"] + [f"tensor_cores:{n}" for n in range(len(tensor_cores.rows(run.args.quick)))]
    jobs += [f"training:{n}" for n in range(len(tensor_core_training.rows(run.args.quick)))]
    return jobs + ["decoder", "serving", "flash_attn", "flex"]


def phase_compile(run: Run, phase: Phase) -> None:
    if gate_failed(run):
        phase.note = "the gate did not pass: the timings it would warm up are skipped"
        return
    jobs = compile_jobs(run)
    limit = run.limit("compile")
    stop = time.monotonic() + limit
    pending, running, done = list(jobs), [], {}
    env = run.env()
    try:
        while pending or running:
            while pending and len(running) < run.jobs and time.monotonic() < stop:
                job = pending.pop(0)
                result, log = run.scratch / f"compile-{job.replace(':', '-')}.json", run.scratch / f"compile-{job}.log"
                handle = open(log, "w")
                process = spawn(run.worker("compile", result, job), handle, env)
                running.append((job, process, handle, result, log, time.monotonic()))
            if not running:  # out of time: a job not started is one that timed out
                with open(run.out / "compile.log", "a") as out:
                    for job in pending:
                        done[job] = ("timed out", 0.0, "not started before the phase's limit")
                        out.write(f"\n===== compile {job}: timed out (not started before the phase's limit)\n")
                pending.clear()
                break
            time.sleep(0.2)
            for entry in list(running):
                job, process, handle, result, log, started = entry
                if process.poll() is None and time.monotonic() < stop:
                    continue
                status = finish(process, stop - time.monotonic())
                handle.close()
                running.remove(entry)
                records = read_records(result)
                outcome = records[-1].get("status", "failed") if records else "failed"
                if status is None:
                    outcome = "timed out"
                elif status != 0:
                    outcome = "failed"
                done[job] = (outcome, time.monotonic() - started, records[-1].get("note", "") if records else "")
                with open(run.out / "compile.log", "a") as out:
                    out.write(f"\n===== compile {job}: {outcome} ({done[job][1]:.1f} s)\n")
                    out.write(log.read_text(errors="replace"))
    finally:  # the command interrupted: no job outlives it
        for _, process, handle, *_ in running:
            signal_group(process, signal.SIGKILL)
            handle.close()
    phase.data = {"jobs": {job: list(v) for job, v in done.items()}}
    outcomes = [v[0] for v in done.values()]
    counts = {o: outcomes.count(o) for o in dict.fromkeys(outcomes)}
    phase.note = ", ".join(f"{n} {o}" for o, n in counts.items()) + f" of {len(jobs)} jobs, {run.jobs} at a time"
    if "timed out" in outcomes:
        phase.status = "timed out"
    elif "failed" in outcomes:
        phase.status = "failed"
    elif outcomes and all(o == "skipped" for o in outcomes):
        phase.status = "skipped"
        phase.note += f" ({done[jobs[0]][2]})"
    else:
        phase.status = "passed"
    if run.args.dry_run:
        phase.note += "; dry run: tiny sizes in the simulator, numpy arrays in place of CUDA tensors"


def phase_timings(run: Run, phase: Phase) -> None:
    if gate_failed(run):
        phase.note = "the gate did not pass: the tensor-core timings are not worth reporting"
        return
    limit = run.limit("timings")
    stop = time.monotonic() + limit
    tables: dict[str, dict] = {}
    names = list(TABLES)
    for n, table in enumerate(names):
        share = TABLES[table] / sum(TABLES[t] for t in names[n:])
        budget = (stop - time.monotonic()) * share
        result = run.scratch / f"timings-{table}.json"
        skipped = [t["reason"] for t in tables.values() if t["status"] == "skipped" and t.get("no_gpu")]
        if skipped:  # no GPU for one table is none for the others
            tables[table] = {"status": "skipped", "reason": skipped[0], "records": [], "no_gpu": True}
            continue
        if budget < MIN_TABLE_SECONDS.get(table, 5.0):
            tables[table] = {"status": "skipped", "reason": "no time left in the phase", "records": []}
            continue
        status = run_logged(run.worker("timings", result, table), run.out / "timings.log", run.env(), budget, table)
        records = read_records(result)
        skipped = [r for r in records if r.get("kind") == "skipped"]
        state = "timed out" if status is None else "failed" if status != 0 else "skipped" if skipped else "passed"
        if status == 0 and any(r.get("kind") == "error" for r in records):
            state = "failed"
        reason = skipped[0]["reason"] if skipped else ""
        tables[table] = {"status": state, "records": records, "reason": reason, "no_gpu": bool(skipped)}
    phase.data = {"tables": tables}
    states = [t["status"] for t in tables.values()]
    phase.note = ", ".join(f"{name}: {t['status']}" for name, t in tables.items())
    if "timed out" in states:
        phase.status = "timed out"
    elif "failed" in states:
        phase.status = "failed"
    elif all(s == "skipped" for s in states):
        phase.status = "skipped"
        reasons = dict.fromkeys(t["reason"] for t in tables.values() if t["reason"])
        phase.note = "; ".join(reasons) or phase.note
    else:
        phase.status = "passed"


def phase_sanitizer(run: Run, phase: Phase) -> None:
    sanitizer = find_sanitizer()
    phase.data = {"path": sanitizer}
    if sanitizer is None:
        phase.note = "compute-sanitizer not found (PATH, CUDA_HOME, /usr/local/cuda*, the nvidia wheels)"
        return
    if run.args.dry_run:
        phase.note = f"dry run: the simulator runs no device code to check ({sanitizer} found)"
        return
    if run.phases["environment"].data.get("gpu_reason"):
        phase.note = "no usable GPU"
        return
    if run.left() < 20:
        phase.note = "no time left before the deadline"
        return
    stop = time.monotonic() + run.limit("sanitizer")
    results = {}
    for n, tool in enumerate(("racecheck", "synccheck")):
        budget = (stop - time.monotonic()) / (2 - n)
        result = run.scratch / f"sanitize-{tool}.json"
        command = [sanitizer, "--tool", tool, "--error-exitcode", "9", "--print-limit", "20"]
        status = run_logged(
            command + run.worker("sanitize", result), run.out / "sanitizer.log", run.env(), budget, tool
        )
        results[tool] = "timed out" if status is None else "passed" if status == 0 else "failed"
    phase.data["tools"] = results
    phase.note = ", ".join(f"{tool}: {state}" for tool, state in results.items()) + " (sanitizer.log)"
    states = list(results.values())
    phase.status = "timed out" if "timed out" in states else "failed" if "failed" in states else "passed"


RUNNERS = {
    "environment": phase_environment,
    "gate": phase_gate,
    "correctness": phase_correctness,
    "compile": phase_compile,
    "timings": phase_timings,
    "sanitizer": phase_sanitizer,
}


def run_phases(run: Run) -> None:
    for name in PHASES:
        phase = run.phases[name] = Phase(name)
        if name not in run.args.phases:
            phase.note = "not asked for (--phases)"
            continue
        environment = run.phases["environment"].data
        if name != "environment" and not run.args.dry_run and environment.get("gpu_reason"):
            phase.note = f"no usable GPU: {environment['gpu_reason']}"
            continue
        if name != "environment" and environment.get("compile_reason"):
            phase.note = "Numba-CUDA cannot compile a kernel here (the environment's line)"
            continue
        if name != "environment" and run.left() < 1:
            phase.note = "no time left before the deadline"
            continue
        started = time.monotonic()
        try:
            RUNNERS[name](run, phase)
        except Exception as error:  # the command's own fault: reported, and the next phase runs
            phase.status, phase.note = "failed", f"gpu_check: {type(error).__name__}: {error}"
        except BaseException:  # Ctrl-C or SIGTERM: its processes are killed, the summary says so
            phase.status, phase.note = "timed out", "stopped: the command was interrupted"
            phase.seconds = time.monotonic() - started
            raise
        phase.seconds = time.monotonic() - started
        print(f"gpu_check: {name}: {phase.status} ({phase.seconds:.1f} s) {phase.note}", flush=True)
