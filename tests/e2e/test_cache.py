"""The on-disk kernel cache under concurrency and damage."""

import os
import shutil
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import numpy as np
import pytest

import attncomp as ac

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import sys
import numpy as np
import attncomp as ac

@ac.spec
def windowed(q: ac.f32["B", "H", "T", "D"], k: ac.f32["B", "H", "T", "D"], v: ac.f32["B", "H", "T", "D"],
             *, window: int = 5):
    s = q @ k.mT
    b, h, i, j = ac.index(s)
    return ac.softmax(ac.where((j <= i) & (i - j < window), s, -ac.inf)) @ v

window = int(sys.argv[1])
x = np.random.default_rng(0).standard_normal((1, 2, 37, 8)).astype(np.float32)
fn = ac.compile(windowed, backend="cpu", window=window)
out = fn(x, x, x)
error = float(np.abs(out - ac.interpret(windowed, x, x, x, window=window)).max())
# three rows: the few-row path, whose shared tile code a kernel loaded from the cache must find
few = x[:, :, :3]
error = max(error, float(np.abs(fn(few, few, few) - ac.interpret(windowed, few, few, few, window=window)).max()))
print("error", error)
print("loaded", sum(fn.compilation.program.kernels[0].stats.cache_hits.values()))
assert error < 1e-5
"""


def run_probe(cache: Path, window: int) -> subprocess.CompletedProcess:
    # Numba's compiled code goes beside the generated source (``NUMBA_CACHE_DIR`` would move it)
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    env["ATTNCOMP_CACHE_DIR"] = str(cache)
    return subprocess.run(
        [sys.executable, "-c", PROBE, str(window)], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600
    )


def entries(cache: Path) -> tuple[Path, Path]:
    """A cpu spec's two cache entries: its kernels' module (Numba's code beside it) and its driver."""
    files = sorted(cache.glob("attncomp_cpu_*.py"))
    kernels = [f for f in files if "@njit(" in f.read_text(errors="replace")]
    drivers = [f for f in files if f not in kernels]
    assert len(kernels) == 1 and len(drivers) == 1, files
    return kernels[0], drivers[0]


def unique_window() -> int:
    return 1000 + uuid.uuid4().int % 100_000  # a spec no earlier run has compiled


@pytest.fixture(scope="session")
def probed(tmp_path_factory) -> tuple[Path, int]:
    """A cache one probe process filled (a spec no earlier run compiled), and the probe's window:
    once a test process (a worker runs a module's tests between other modules')."""
    window = unique_window()
    cache = tmp_path_factory.mktemp("probed")
    done = run_probe(cache, window)
    assert done.returncode == 0, done.stderr
    return cache, window


def copy_of(probed: tuple[Path, int], to: Path) -> int:
    """A copy of the probed cache in ``to`` (files, their times kept), and the probe's window."""
    shutil.copytree(probed[0], to, dirs_exist_ok=True)
    return probed[1]


def test_eight_threads_compile_once_and_agree(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNCOMP_CACHE_DIR", str(tmp_path))

    @ac.spec
    def scaled(q: ac.f32["T", "D"], k: ac.f32["S", "D"], v: ac.f32["S", "D"], *, factor: int = 1):
        return ac.softmax(q @ k.mT * factor) @ v

    factor = unique_window()
    x = np.random.default_rng(1).standard_normal((19, 4)).astype(np.float32) / factor
    want = ac.interpret(scaled, x, x, x, factor=factor)
    results, functions, errors = [], [], []

    def work():
        try:
            fn = ac.compile(scaled, backend="cpu", factor=factor)
            functions.append(fn)
            results.append(fn(x, x, x))
        except Exception as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert all(np.abs(r - want).max() < 1e-5 for r in results)
    assert len({id(fn.compilation.program.module) for fn in functions}) == 1  # one module, so one Numba compile
    assert len(functions[0].compilation.program.kernels[0].signatures) == 1
    entries(tmp_path)


@pytest.mark.long
def test_two_processes_share_one_cache_directory(tmp_path):
    window = unique_window()
    env = {**os.environ, "ATTNCOMP_CACHE_DIR": str(tmp_path)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", PROBE, str(window)],
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    loaded = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err
        loaded.append(int(out.split("loaded")[1]))
    # the two imported the module at once: one compiled it, the other waited and loaded what it wrote
    assert sorted(x > 0 for x in loaded) == [False, True], loaded
    entries(tmp_path)
    again = run_probe(tmp_path, window)  # a third process finds a valid cache
    assert again.returncode == 0, again.stderr
    assert "damaged" not in again.stderr and "corrupted" not in again.stderr


@pytest.mark.long
def test_damaged_entries_are_detected_and_rebuilt(tmp_path, probed):
    window = copy_of(probed, tmp_path)
    source, _ = entries(tmp_path)
    data = list((tmp_path / "__pycache__").glob(f"{source.stem}.*.nbc"))
    assert data, "Numba wrote no cache"
    for entry in data:
        entry.write_bytes(entry.read_bytes()[:50])  # truncated compiled code
    damaged = run_probe(tmp_path, window)
    assert damaged.returncode == 0, damaged.stderr
    assert "was damaged; rebuilding it" in damaged.stderr
    source.write_text(source.read_text()[:200])  # a truncated generated source
    truncated = run_probe(tmp_path, window)
    assert truncated.returncode == 0, truncated.stderr
    assert "was corrupted; rebuilding it" in truncated.stderr
    assert run_probe(tmp_path, window).stderr.count("rebuilding") == 0


@pytest.mark.parametrize("bad", [b"\xff\xfe not text", b""])
@pytest.mark.parametrize("entry", [0, 1], ids=["kernels", "driver"])
def test_unreadable_source_entry(tmp_path, bad, entry, probed):
    window = copy_of(probed, tmp_path)
    entries(tmp_path)[entry].write_bytes(bad)
    result = run_probe(tmp_path, window)
    assert result.returncode == 0, result.stderr
    assert "was corrupted; rebuilding it" in result.stderr


def test_a_changed_backend_helper_gets_new_cache_entries(tmp_path, monkeypatch):
    """Numba bakes the helpers a kernel calls into its cached code, so the cache names an entry by
    attncomp's own code too: the same kernel text under another attncomp is another entry."""
    from attncomp.backends import cache

    monkeypatch.setenv("ATTNCOMP_CACHE_DIR", str(tmp_path))
    source = f"VALUE = {unique_window()}\n"
    first = cache.load_source(source, "test")
    assert cache.load_source(source, "test") is first  # the same code: the same entry
    monkeypatch.setattr(cache, "_RUNTIME", ["a-different-attncomp"])
    second = cache.load_source(source, "test")
    assert second is not first and second.__name__ != first.__name__
    assert len(list(tmp_path.glob("attncomp_test_*.py"))) == 2
    assert cache.runtime_digest() == "a-different-attncomp"


def test_attncomps_compiled_helpers_are_stamped_by_its_code(monkeypatch):
    """``tile_math``'s functions call ``vector_loops``' intrinsics, which Numba bakes into their cached
    code: their cache entries are stamped by attncomp's code as well as their own file, so a change
    to a helper they call alone compiles them again."""
    from attncomp.backends import cache
    from attncomp.backends.numba_cpu import tile_math

    locator = tile_math.group_values._cache._impl._locator
    own_file, code = locator.get_source_stamp()
    assert code == cache.runtime_digest()
    monkeypatch.setattr(cache, "_RUNTIME", ["a-different-attncomp"])
    assert locator.get_source_stamp() == (own_file, "a-different-attncomp")  # another stamp: a miss


SHIFTED = """
import sys
import numpy as np
from numba import njit

for shift in range(int(sys.argv[2])):  # compiles first: Numba numbers what it compiles next differently
    njit(lambda x, s=shift: x + s)(1.0)
import attncomp as ac

@ac.spec
def windowed(q: ac.f32["H", "T", "D"], k: ac.f32["H", "T", "D"], v: ac.f32["H", "T", "D"], *, window: int = 5):
    s = q @ k.mT
    h, i, j = ac.index(s)
    return ac.softmax(ac.where((j <= i) & (i - j < window), s, -ac.inf)) @ v

window = int(sys.argv[1])
x = np.random.default_rng(0).standard_normal((2, 3, 8)).astype(np.float32)  # three rows: the few-row path
fn = ac.compile(windowed, backend="cpu", window=window)
error = float(np.abs(fn(x, x, x) - ac.interpret(windowed, x, x, x, window=window)).max())
print("loaded", sum(fn.compilation.program.kernels[0].stats.cache_hits.values()))
assert error < 1e-5, error
"""


@pytest.mark.long
def test_a_cached_kernel_finds_shared_code_another_process_compiled(tmp_path):
    """A kernel calls the shared tile code by a name of attncomp's own: Numba names what it compiles
    with a count of the process's compiles, so a kernel cached by one process and the tile code
    compiled again by another (its cache entry lost, or written by a concurrent process) name the
    same function differently."""
    window = unique_window()
    numba_cache = tmp_path / "numba"
    env = {**os.environ, "ATTNCOMP_CACHE_DIR": str(tmp_path), "NUMBA_CACHE_DIR": str(numba_cache)}

    def probe(shift: int) -> subprocess.CompletedProcess:
        command = [sys.executable, "-c", SHIFTED, str(window), str(shift)]
        return subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)

    first = probe(7)
    assert first.returncode == 0, first.stderr
    shared = list(numba_cache.rglob("tile_math.*"))
    assert shared, "no cached tile code"
    for entry in shared:
        entry.unlink()
    again = probe(0)  # loads the kernel, compiles the tile code anew
    assert again.returncode == 0, again.stderr[-3000:]
    assert int(again.stdout.split("loaded")[1]) > 0
