"""Generated source on disk: one file per kernel key, imported as a module.

Numba's ``cache=True`` keeps compiled machine code beside the source file it
was defined in, keyed by the file's timestamp; a file is only rewritten when
its text changes, so a new process with the same spec imports it and skips
Numba's compile.  Writes go to a temporary file renamed into place, so
processes sharing the directory never see a partial file.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import sys
import tempfile
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType


def cache_dir() -> Path:
    """``$ATTNCOMP_CACHE_DIR``, else ``$XDG_CACHE_HOME/attncomp``, else ``~/.cache/attncomp``."""
    explicit = os.environ.get("ATTNCOMP_CACHE_DIR")
    if explicit:
        path = Path(explicit)
    else:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        path = Path(base) / "attncomp"
    path.mkdir(parents=True, exist_ok=True)
    return path


def source_key(*parts: str) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()[:24]


def _write_atomically(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


_LOCK = threading.Lock()
_RUNTIME: list[str] = []


def runtime_digest() -> str:
    """A digest of attncomp's own code, whose helpers generated kernels import.

    Numba's cache keys compiled code by the file that defines a kernel and bakes the helpers it
    calls (``tile_math``, ``warp``, ...) into it, so a kernel cached by an older attncomp would keep
    the older helpers: the digest is part of every cache key, and a changed helper recompiles."""
    if not _RUNTIME:
        root = Path(__file__).resolve().parents[1]
        digest = hashlib.sha256()
        for path in sorted(root.rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
        _RUNTIME.append(digest.hexdigest()[:16])
    return _RUNTIME[0]


class _HelperStamp:
    """A Numba cache locator's mixin: attncomp's own functions only, stamped by attncomp's code too."""

    attncomp_helpers = True

    def get_source_stamp(self):
        return (super().get_source_stamp(), runtime_digest())

    @classmethod
    def from_function(cls, py_func, py_file):
        if not (py_func.__module__ or "").startswith("attncomp."):
            return None
        return super().from_function(py_func, py_file)


def stamp_helpers_by_runtime() -> None:
    """Key the Numba cache of attncomp's own compiled helpers (``tile_math``, the page copies) by
    :func:`runtime_digest` as well as by their file.

    Numba stamps a cached function with a hash of the file that defines it, and bakes the functions
    it calls (``vector_loops``' intrinsics, say) into its code: a change to those alone would leave
    the cached helper running the old code.  Numba's locators for a file's functions (the directory
    ``NUMBA_CACHE_DIR`` names, else beside the file, else the user's cache), each with that stamp,
    are tried before Numba's own.  Idempotent; installed by ``attncomp.backends`` before any of its
    modules defines a helper."""
    from numba.core import caching

    if any(getattr(c, "attncomp_helpers", False) for c in caching.CacheImpl._locator_classes):
        return
    bases = (caching.UserProvidedCacheLocator, caching.InTreeCacheLocator, caching.UserWideCacheLocator)
    stamped = [type(f"Helper{base.__name__}", (_HelperStamp, base), {}) for base in bases]
    caching.CacheImpl._locator_classes[:0] = stamped


def module_name(source: str, prefix: str) -> str:
    """The module ``load_source(source, prefix)`` imports: named by the text and
    :func:`runtime_digest`, so a driver can import the kernels' module by name."""
    return f"attncomp_{prefix}_{source_key(runtime_digest(), source)}"


def load_source(source: str, prefix: str) -> ModuleType:
    """Import ``source`` from the cache directory (writing it if needed), under a name from its text
    and :func:`runtime_digest`.

    Threads compiling the same spec share one module, so Numba compiles once.
    """
    name = module_name(source, prefix)
    with _LOCK:
        if name in sys.modules:
            return sys.modules[name]
        with one_compiler(name):
            return _import(source, name)


@contextlib.contextmanager
def one_compiler(name: str) -> Iterator[None]:
    """Hold the cache entry ``name`` for this process while it imports (and so compiles) it.

    Processes that share the cache directory (the ranks of a distributed job, a test run's workers)
    often import the same kernel at once; each would compile it.  With the entry's lock file
    (``locks/NAME.lock``, locked by ``flock``), the first compiles and writes Numba's cache, and the
    others wait, then load what it wrote.  A process that dies releases its lock; where ``fcntl`` is
    missing (Windows) every process compiles, as without the lock."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    folder = cache_dir() / "locks"
    folder.mkdir(exist_ok=True)
    with open(folder / f"{name}.lock", "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX)
        except OSError:  # a file system without locks (some network mounts): compile as without one
            yield
            return
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _import(source: str, name: str, again: bool = False) -> ModuleType:
    path = cache_dir() / f"{name}.py"
    try:
        current = path.read_text() if path.exists() else None
    except (OSError, ValueError):  # unreadable or not text: rewritten below
        current = ""
    if current != source:
        if current is not None:
            warnings.warn(f"attncomp: cache entry {path} was corrupted; rebuilding it", stacklevel=2)
        _write_atomically(path, source)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)  # kernels with explicit signatures compile (or load) here
    except BaseException as exc:
        del sys.modules[name]
        if again or not from_numba_cache(exc):
            raise
        _drop_compiled(path)
        return _import(source, name, again=True)
    return module


def from_numba_cache(exc: BaseException) -> bool:
    """Whether ``exc`` was raised while Numba read its on-disk cache (a damaged entry)."""
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.endswith(os.path.join("numba", "core", "caching.py")):
            return True
        tb = tb.tb_next
    return False


def _drop_compiled(path: Path) -> None:
    """Warn that Numba's cached code for ``path`` is damaged, and delete it."""
    warnings.warn(f"attncomp: the compiled-code cache of {path.name} was damaged; rebuilding it", stacklevel=4)
    for entry in (path.parent / "__pycache__").glob(f"{path.stem}.*"):
        try:
            entry.unlink()
        except OSError:
            pass
