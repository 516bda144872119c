"""``--write``: a benchmark's printed table kept in ``benchmarks/RESULTS.md``, by the command itself.

Each benchmark's ``main`` adds the option (:func:`add_option`) and prints inside
:func:`recorded`.  With ``--write`` what it printed becomes one section of RESULTS.md, headed by
the command that made it (``--write`` left out), the machine, the date, the commit and the load
average when it started; a later run of the same command replaces its section and leaves the
others as they are.  Figures in RESULTS.md are only ever written this way, never by hand.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import os
import platform
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

#: where the tables are kept
RESULTS = Path(__file__).with_name("RESULTS.md")
#: RESULTS.md's opening, above the sections
HEADER = """# Benchmark results

Every table below was written by the command above it, run with `--write`
(`benchmarks/results_file.py`): the machine, the date, the commit and the load average when it
started are the run's own.  Ratios are medians of per-pair ratios, the two calls alternated in one
run (`benchmarks/timing.py`).  GPU figures are not here: they are the GPU check's summaries in
`benchmarks/results/`.
"""
#: what opens a section: the heading of its command
OPENING = "## `"


def add_option(parser: argparse.ArgumentParser) -> None:
    """Add ``--write`` to a benchmark's command line."""
    parser.add_argument(
        "--write",
        action="store_true",
        help=f"also keep what this prints as its section of {RESULTS.relative_to(RESULTS.parents[1])}",
    )


def command_of(module: str, argv: Sequence[str] | None) -> str:
    """The command a run was made with, ``--write`` left out: ``python -m MODULE ARGS``."""
    args = list(sys.argv[1:] if argv is None else argv)
    return " ".join(["python", "-m", module, *[a for a in args if a != "--write"]])


def machine() -> str:
    """The CPU's model and core count, and the GPU's name where torch sees one."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            model = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), model)
    except OSError:
        pass
    text = f"{model}, {os.cpu_count()} cores"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        text += f", {torch.cuda.get_device_name()}"
    return text


def commit() -> str:
    """The checkout's commit (``+changes`` when its tracked files, RESULTS.md aside, differ from it),
    or ``unknown``."""
    root = RESULTS.parents[1]
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
        others = f":(exclude){RESULTS.relative_to(root)}"  # the file's own earlier sections are no change
        dirty = subprocess.run(
            ["git", "diff", "--quiet", "HEAD", "--", ".", others], cwd=root, capture_output=True
        ).returncode
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+changes" if dirty else "")


def section(command: str, text: str, when: datetime.datetime, load: float) -> str:
    """One section of RESULTS.md: the command as its heading, the run's facts, the printed text."""
    facts = f"{machine()}; {when:%Y-%m-%d %H:%M} UTC; commit {commit()}; load average {load:.1f} at the start"
    return f"{OPENING}{command}`\n\n{facts}\n\n```\n{text.rstrip()}\n```\n"


def sections(text: str) -> dict[str, str]:
    """RESULTS.md's sections by command, in order."""
    found: dict[str, str] = {}
    for chunk in text.split("\n" + OPENING)[1:]:
        command = chunk.split("`", 1)[0]
        found[command] = OPENING + chunk.rstrip("\n") + "\n"
    return found


def write(command: str, text: str, path: Path | None = None, load: float | None = None) -> None:
    """Keep ``text`` as ``command``'s section of ``path`` (RESULTS.md): replaced where the command
    has one, appended where not; the rest of the file as it was.  Written whole, then renamed into
    place."""
    path = RESULTS if path is None else path
    when = datetime.datetime.now(datetime.timezone.utc)
    load = os.getloadavg()[0] if load is None else load
    kept = sections(path.read_text()) if path.exists() else {}
    kept[command] = section(command, text, when, load)
    body = HEADER + "".join("\n" + s for s in kept.values())
    scratch = path.with_suffix(".md.new")
    scratch.write_text(body)
    scratch.replace(path)


@contextlib.contextmanager
def recorded(args: argparse.Namespace, module: str, argv: Sequence[str] | None = None) -> Iterator[None]:
    """Print as usual; with ``args.write`` also keep what was printed as the command's section of
    RESULTS.md (only when the body finished: a failed run writes nothing)."""
    if not getattr(args, "write", False):
        yield
        return
    load = os.getloadavg()[0]
    printed = io.StringIO()
    with contextlib.redirect_stdout(_Tee(sys.stdout, printed)):
        yield
    write(command_of(module, argv), printed.getvalue(), load=load)
    print(f"written: {command_of(module, argv)} in {RESULTS.name}")


class _Tee(io.TextIOBase):
    """A stream writing to two."""

    def __init__(self, *streams: io.TextIOBase):
        self.streams = streams

    def write(self, text: str) -> int:
        for stream in self.streams:
            stream.write(text)
        return len(text)

    def flush(self) -> None:
        for stream in self.streams:
            stream.flush()
