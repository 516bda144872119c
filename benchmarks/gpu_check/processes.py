"""The subprocesses: starting one in a session of its own, stopping it and every child of it when its
time is up, its log, and the JSON records a worker writes for the phase that started it.

No pipe connects a child to the command (its output goes to a file), and no wait is unbounded, so the
command cannot hang on a child."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import time
from pathlib import Path

from benchmarks.gpu_check.plan import KILL_WAIT, LOG_BYTES, ROOT


def spawn(command: list[str], log, env: dict[str, str]) -> subprocess.Popen:
    """Start ``command`` in the checkout, in a session of its own (so that a timeout ends its children
    too), its output into the open file ``log``."""
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def signal_group(process: subprocess.Popen, sig: int) -> None:
    """Send ``sig`` to the process and every child of its session (those left after it exited too)."""
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        pass  # the whole group is gone
    except PermissionError:
        process.send_signal(sig)


def finish(process: subprocess.Popen, timeout: float, grace: float = 0.0) -> int | None:
    """Wait up to ``timeout`` seconds; the exit status, or None when it ran out of time: then the
    process and every child of its session are interrupted (SIGINT: pytest then writes its summary
    and junit file) and, ``grace`` seconds later, killed. Either way no process of its session is left
    running; one that a kill does not end within ``KILL_WAIT`` seconds (stuck in the driver) is left,
    not waited on. An interruption of the command itself (Ctrl-C) kills the session first."""
    try:
        status = process.wait(timeout=max(timeout, 0.1))
        signal_group(process, signal.SIGKILL)  # a child it left behind
        return status
    except subprocess.TimeoutExpired:
        pass
    except BaseException:
        signal_group(process, signal.SIGKILL)
        raise
    try:
        if grace > 0:
            signal_group(process, signal.SIGINT)
            try:
                process.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
    finally:
        signal_group(process, signal.SIGKILL)  # also when the process ended on SIGINT and left children
    try:
        process.wait(timeout=KILL_WAIT)
    except subprocess.TimeoutExpired:
        pass
    return None


def run_logged(
    command: list[str], log_path: Path, env: dict[str, str], timeout: float, title: str, grace: float = 0.0
) -> int | None:
    """Run ``command`` with its output appended to ``log_path`` under a header; its exit status, or None
    when it timed out (interrupted ``grace`` seconds before the end of ``timeout``, then killed)."""
    with open(log_path, "a") as log:
        log.write(f"\n===== {title}\n$ {shlex.join(command)}\n")
        log.flush()
        started = time.monotonic()
        grace = min(grace, timeout / 4)
        status = finish(spawn(command, log, env), timeout - grace, grace)
        elapsed = time.monotonic() - started
        ending = f"timed out after {elapsed:.0f} s" if status is None else f"exit {status} after {elapsed:.1f} s"
        log.write(f"===== {title}: {ending}\n")
    return status


def emit(result: Path, record: dict) -> None:
    """Append one record to a worker's result file (a JSON line)."""
    with open(result, "a") as handle:
        handle.write(json.dumps(record) + "\n")


def read_records(path: Path) -> list[dict]:
    """The JSON lines a worker wrote (each a record), skipping a line cut short."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def cap_file(path: Path, limit: int = LOG_BYTES) -> None:
    """Cut a log longer than ``limit`` bytes to its first megabyte and its last ``limit - 1 MB``."""
    if not path.exists() or path.stat().st_size <= limit:
        return
    head_size = 2**20
    with open(path, "rb") as handle:
        head = handle.read(head_size)
        handle.seek(-(limit - head_size), os.SEEK_END)
        tail = handle.read()
    marker = f"\n\n[... {path.stat().st_size - len(head) - len(tail)} bytes cut ...]\n\n".encode()
    path.write_bytes(head + marker + tail)
