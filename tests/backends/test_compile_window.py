"""``backends/compile_window.py``: Numba compiles attncomp's kernels with the cyclic garbage
collector paused, and the collector runs again, as it did before, when the last window closes."""

import gc
import importlib.util
import threading
import uuid

import numpy as np
import pytest

import attncomp as ac
from attncomp.backends import call_types, compile_window


@pytest.fixture
def collector_on():
    was = gc.isenabled()
    gc.enable()
    yield
    if not was:
        gc.disable()


def collector_state(event, seen: list[bool]):
    """A listener of ``event`` (Numba's or numba-cuda's event module) that appends to ``seen``
    whether the collector runs as each pass starts."""

    class Passes(event.Listener):
        def on_start(self, ev) -> None:
            seen.append(gc.isenabled())

        def on_end(self, ev) -> None:
            pass

    return Passes()


def test_the_collector_is_paused_inside_and_runs_again_after(collector_on):
    with compile_window.window("cpu"):
        assert not gc.isenabled()
        assert call_types.compiling()
        with compile_window.collection_paused():  # nested: the inner end does not restart it
            pass
        assert not gc.isenabled()
    assert gc.isenabled() and not call_types.compiling()


def test_a_collector_the_user_stopped_stays_stopped(collector_on):
    gc.disable()
    with compile_window.collection_paused():
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_windows_of_two_threads_share_one_pause(collector_on):
    inside, release = threading.Event(), threading.Event()

    def other():
        with compile_window.collection_paused():
            inside.set()
            release.wait(30)

    thread = threading.Thread(target=other)
    thread.start()
    assert inside.wait(30)
    with compile_window.collection_paused():
        pass
    assert not gc.isenabled()  # the other thread's window is still open
    release.set()
    thread.join()
    assert gc.isenabled()


def test_a_raising_block_restarts_the_collector(collector_on):
    with pytest.raises(KeyError):
        with compile_window.collection_paused():
            raise KeyError("x")
    assert gc.isenabled()


def test_every_pass_of_a_cpu_spec_runs_with_the_collector_paused(tmp_path, monkeypatch, collector_on):
    from numba.core import event

    monkeypatch.setenv("ATTNCOMP_CACHE_DIR", str(tmp_path))

    # a window width no other test uses: it is in the kernels' text (their tiles' key bounds), so
    # the kernels compile here, not loaded from the cache or from another test's module
    @ac.spec
    def reaching_back(q: ac.f32["T", "D"], k: ac.f32["S", "D"], v: ac.f32["S", "D"], *, window: int = 1):
        s = q @ k.mT
        i, j = ac.index(s)
        return ac.softmax(ac.where(i - j < window, s, -ac.inf)) @ v

    window = 1000 + uuid.uuid4().int % 100_000
    x = np.random.default_rng(1).standard_normal((7, 4)).astype(np.float32)
    seen: list[bool] = []
    with event.install_listener("numba:run_pass", collector_state(event, seen)):
        out = ac.compile(reaching_back, backend="cpu", window=window)(x, x, x)
    assert np.abs(out - ac.interpret(reaching_back, x, x, x, window=window)).max() < 1e-5
    assert seen and not any(seen), f"{sum(seen)} of {len(seen)} passes ran with the collector on"
    assert gc.isenabled()


@pytest.mark.skipif(importlib.util.find_spec("numba_cuda") is None, reason="needs the cuda extra")
def test_every_pass_of_a_kernels_ptx_runs_with_the_collector_paused(collector_on):
    from numba.cuda.core import event

    from attncomp.backends.numba_cuda.ptx import compile_ptx_for

    def kernel(out):
        out[0] = 2.0 * out[0]

    seen: list[bool] = []
    with event.install_listener("numba-cuda:run_pass", collector_state(event, seen)):
        ptx = compile_ptx_for(kernel, "void(float32[::1])", [(8, 0)])
    assert ".entry" in ptx[8, 0]
    assert seen and not any(seen), f"{sum(seen)} of {len(seen)} passes ran with the collector on"
    assert gc.isenabled()
