"""The one-line notice a first call prints while Numba compiles (backends/notice.py)."""

import time
from types import SimpleNamespace

import pytest

import attncomp as ac
from attncomp.backends import notice
from tests.conftest import load_example


@pytest.fixture
def short_delay(monkeypatch):
    monkeypatch.setattr(notice, "DELAY", 0.01)
    monkeypatch.delenv("ATTNCOMP_QUIET", raising=False)


def test_a_slow_pending_call_says_what_compiles_once(short_delay, capsys):
    with notice.compile_notice("causal", "cpu", pending=True):
        time.sleep(0.2)
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("attncomp: compiling @causal for the cpu backend with Numba")
    assert "cached on disk" in err and "ATTNCOMP_QUIET=1" in err


def test_fast_calls_compiled_kernels_and_quiet_print_nothing(short_delay, capsys, monkeypatch):
    with notice.compile_notice("causal", "cpu", pending=True):
        pass  # done before the delay
    with notice.compile_notice("causal", "cpu", pending=False):
        time.sleep(0.05)
    monkeypatch.setenv("ATTNCOMP_QUIET", "1")
    with notice.compile_notice("causal", "cpu", pending=True):
        time.sleep(0.05)
    time.sleep(0.05)
    assert capsys.readouterr().err == ""


def test_only_a_first_call_with_uncompiled_kernels_is_pending():
    fn = ac.compile(load_example("causal").causal, backend="cpu")  # builds the source; Numba compiles on first use
    compilation = fn.compilation
    assert compilation.program.compiled is False
    assert compilation.first_call() is True
    assert compilation.first_call() is False  # once per compiled function
    compilation.called = False
    compilation.program = SimpleNamespace(compiled=True)
    assert compilation.first_call() is False  # already compiled (or loaded from the cache) in this process
