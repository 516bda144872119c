"""A pytest plugin for the pytest phases (``-p benchmarks.gpu_check.outcomes``): every test's outcome
is written as it finishes, so that a phase cut short at its limit keeps what it learned.

- ``GPU_CHECK_OUTCOMES=FILE``: one tab-separated line per test, ``outcome  seconds  node id``,
  appended as the test finishes; a failure's report is also printed into the log at once (pytest
  would print it only in its closing summary, which a phase killed at its limit never reaches).
- ``GPU_CHECK_DONE=FILE``: the tests that such a file from an earlier run lists are deselected, so a
  second command runs the rest of a correctness phase that ran out of time (``--after``).

With xdist the controller receives every worker's reports, and only it writes.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the command reads outcome files without importing pytest
    import pytest

#: the file's outcomes: a test listed with one of them has run
OUTCOMES = ("passed", "failed", "skipped", "error")


def read_outcomes(path: Path) -> dict[str, str]:
    """``{node id: outcome}`` of an outcomes file (the last line of a test wins)."""
    return {node: outcome for node, (outcome, _) in read_lines(path).items()}


def read_seconds(path: Path) -> dict[str, float]:
    """``{node id: seconds}`` of an outcomes file: each test's call (or failed set-up) as it ran."""
    return {node: seconds for node, (_, seconds) in read_lines(path).items()}


def read_lines(path: Path) -> dict[str, tuple[str, float]]:
    """``{node id: (outcome, seconds)}`` of an outcomes file (the last line of a test wins)."""
    found = {}
    for line in path.read_text(errors="replace").splitlines():
        fields = line.split("\t")
        if len(fields) == 3 and fields[0] in OUTCOMES:
            try:
                seconds = float(fields[1])
            except ValueError:
                seconds = float("nan")
            found[fields[2]] = (fields[0], seconds)
    return found


def pytest_configure(config: pytest.Config) -> None:
    path = os.environ.get("GPU_CHECK_OUTCOMES")
    if path and not hasattr(config, "workerinput"):  # the controller, or a run without xdist
        config.pluginmanager.register(Outcomes(config, Path(path)), "gpu_check_outcomes")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    done_file = os.environ.get("GPU_CHECK_DONE")
    if not done_file or not Path(done_file).exists():
        return
    done = read_outcomes(Path(done_file))
    dropped = [item for item in items if item.nodeid in done]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for item in items if item.nodeid not in done]


def outcome_of(report: pytest.TestReport) -> str | None:
    """The test's outcome from one of its reports, or None where the report says nothing final."""
    if report.when == "call":
        return "skipped" if report.skipped else "passed" if report.passed else "failed"
    if report.failed:  # a set-up or tear-down that failed
        return "error"
    if report.when == "setup" and report.skipped:
        return "skipped"
    return None


class Outcomes:
    def __init__(self, config: pytest.Config, path: Path):
        self.config = config
        self.path = path

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        outcome = outcome_of(report)
        if outcome is None:
            return
        with open(self.path, "a") as handle:
            handle.write(f"{outcome}\t{report.duration:.2f}\t{report.nodeid}\n")
        if outcome in ("failed", "error"):
            reporter = self.config.pluginmanager.get_plugin("terminalreporter")
            if reporter is not None:
                reporter.write_line("")
                reporter.write_sep("-", f"{outcome.upper()} {report.nodeid} ({report.when})")
                reporter.write_line(report.longreprtext)
