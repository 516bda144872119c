"""Where a call's time goes on the host: a call's wall time queued (no wait for the device between
calls) against drained (the device's queue emptied after each), the functions that take the
most of the queued calls' time under ``cProfile``, and each launch's host time and span on the
stream (``attncomp/backends/numba_cuda/host/launch_times.py``: a span well over its issue time is
the kernel's own).

A step whose queued time is near its drained time is bound by the host (Python, argument
conversion, Numba's dispatch), not by its kernels: the decoding rows of ``benchmarks.gpu`` on an
H100 took 1.5 to 2 ms a step where SDPA takes 0.1 to 0.26, far more than their kernels' reads of
keys and values need. The GPU check prints these lines after the decoder rows.
"""

from __future__ import annotations

import cProfile
import pstats
import time
from collections.abc import Callable
from pathlib import Path

#: calls profiled a case
CALLS = 100
#: functions listed a case
TOP = 12


def host_lines(name: str, call: Callable[[], object], drain: Callable[[], None], calls: int = CALLS) -> list[str]:
    """``name``'s wall time a call queued and drained, then its ``TOP`` functions by own time under
    ``cProfile``, each per call: own microseconds, calls, cumulative microseconds, where."""
    call()
    drain()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    queued = time.perf_counter() - start
    drain()
    start = time.perf_counter()
    for _ in range(calls):
        call()
        drain()
    drained = time.perf_counter() - start
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(calls):
        call()
    profile.disable()
    drain()
    lines = [
        f"{name}: {queued / calls * 1e6:.0f} us a call queued, {drained / calls * 1e6:.0f} us drained "
        f"({calls} calls); by own time under cProfile (us a call, calls a call, cumulative us, where):"
    ]
    stats = pstats.Stats(profile).stats  # {(file, line, function): (primitive calls, calls, own, cumulative, callers)}
    ranked = sorted(stats.items(), key=lambda item: item[1][2], reverse=True)[:TOP]
    for (file, line, function), (_, count, own, cumulative, _) in ranked:
        where = f"{Path(file).name}:{line} {function}" if line else function
        lines.append(f"  {own / calls * 1e6:8.1f} {count / calls:6.1f} {cumulative / calls * 1e6:9.1f}  {where}")
    return lines


def launch_lines(name: str, call: Callable[[], object], drain: Callable[[], None], calls: int = 20) -> list[str]:
    """``name``'s launches a call: per kernel its host issue time and its span on the stream, each
    call drained first (so that a call's first span starts on an idle stream)."""
    from attncomp.backends.numba_cuda.host.launch_times import anatomy, launch_times

    call()
    drain()
    with launch_times() as records:
        for _ in range(calls):
            call()
            drain()
    return [f"{name}: {anatomy(records, calls)}"]


def decode_profile_lines(torch, quick: bool) -> list[str]:
    """The host profiles and launch times of the decoding rows of ``benchmarks.gpu``: the bf16 torch
    op's call (heads packed), the float32 decoder's step, and the paged decoder's shared-prompt step
    (8 sequences of a 1,024-token prompt, host arrays in and out: the serving row)."""
    from benchmarks.gpu import bf16_decode_case, decoder_step_case
    from benchmarks.serving import shared_prompt

    drain = torch.cuda.synchronize
    op, q, k, v = bf16_decode_case(torch, quick)
    lines = host_lines("bf16 decode step (torch op)", lambda: op(q, k, v), drain)
    lines += launch_lines("bf16 decode step (torch op)", lambda: op(q, k, v), drain)
    step = decoder_step_case(torch, quick)[0]
    lines += host_lines("float32 decoder step", step, drain) + launch_lines("float32 decoder step", step, drain)
    calls = 30  # a step took 27 ms on an H100
    served = shared_prompt("cuda", users=8, prompt=1024, own=16, steps=3 * calls + 2 + 21)  # the steps below
    paged = lambda: served.srv.step(served.token)  # noqa: E731
    lines += host_lines("paged decode step", paged, drain, calls)
    return lines + launch_lines("paged decode step", paged, drain)
