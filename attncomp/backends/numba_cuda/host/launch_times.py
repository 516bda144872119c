"""Where a call's time goes on the GPU: each launch's kernel, its host time and its span on the stream.

Inside :func:`launch_times` every launch (``launches.launch``) is recorded: the kernel's name, its grid
and block, the host's time to issue it (numba-cuda's argument preparation and the driver call, from
before the dispatcher is configured to its return), and its span on the stream, between CUDA events
recorded on the call's stream just before and just after it.  A span holds the kernel's run, and
also the issue time wherever the stream was idle when the launch began (the usual case in a step of
a few launches): ``span - issue`` is then the kernel's own time, and a call whose time is mostly
issue is bound by the host.  Under Numba's simulator, which runs each launch to its end before
returning and whose events time nothing, the span is the host's time too.

``benchmarks.gpu`` prints the anatomy of its decoding rows with it (:func:`anatomy`), so that a GPU
run says whether a slow step waits on the host or on a kernel.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any


@dataclass
class LaunchTime:
    """One recorded launch (times in milliseconds; ``span`` set when :func:`launch_times` ends)."""

    kernel: str
    grid: Any
    block: Any
    issue: float
    span: float = float("nan")
    events: tuple[Any, Any] | None = field(default=None, repr=False)


_RECORD: contextvars.ContextVar[list[LaunchTime] | None] = contextvars.ContextVar("attncomp_launch_times", default=None)


def recording() -> list[LaunchTime] | None:
    """The list the current launches are recorded into, or None outside :func:`launch_times`."""
    return _RECORD.get()


@contextlib.contextmanager
def launch_times() -> Iterator[list[LaunchTime]]:
    """Record every launch inside into the list it yields (each launch's ``span`` is read when the
    block ends, after its stop event completes)."""
    records: list[LaunchTime] = []
    token = _RECORD.set(records)
    try:
        yield records
    finally:
        _RECORD.reset(token)
        for record in records:
            if record.events is not None:
                start, stop = record.events
                stop.synchronize()
                record.span = float(start.elapsed_time(stop))
                record.events = None


def timed(
    records: list[LaunchTime], name: str, grid: Any, block: Any, run: Callable[[], None], simulated: bool, stream: Any
) -> None:
    """Run ``run`` (one launch) recorded into ``records``: host time around it, and CUDA events on
    ``stream`` before and after it (on a GPU)."""
    from numba import cuda

    events = None
    if not simulated:
        events = (cuda.event(timing=True), cuda.event(timing=True))
        events[0].record(stream)
    began = time.perf_counter()
    run()
    issue = (time.perf_counter() - began) * 1e3
    record = LaunchTime(name, grid, block, issue)
    if events is not None:
        events[1].record(stream)
        record.events = events
    else:
        record.span = issue
    records.append(record)


def kernel_name(kernel: Any) -> str:
    """A dispatcher's kernel name (its Python function's)."""
    return getattr(getattr(kernel, "py_func", None), "__name__", None) or getattr(kernel, "__name__", "kernel")


def anatomy(records: list[LaunchTime], calls: int = 1) -> str:
    """One line: per kernel (in launch order, summed over ``calls`` calls and divided by them) its
    host issue time and its span, in microseconds, and the totals."""
    by_kernel: dict[str, list[float]] = {}
    for record in records:
        sums = by_kernel.setdefault(record.kernel, [0.0, 0.0, 0.0])  # issue, span, launches
        sums[0] += record.issue
        sums[1] += record.span
        sums[2] += 1
    parts = [
        f"{name} x{count / calls:g}: issue {issue / calls * 1e3:.0f} us, span {span / calls * 1e3:.0f} us"
        for name, (issue, span, count) in by_kernel.items()
    ]
    issue = sum(r.issue for r in records) / calls * 1e3
    span = sum(r.span for r in records) / calls * 1e3
    return f"{len(records) / calls:g} launches a call, issue {issue:.0f} us, span {span:.0f} us: " + "; ".join(parts)
