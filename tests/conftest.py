"""Shared fixtures (a seeded random generator, the example specs) and the order and garbage collection of a run."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def load_example(name: str):
    """Import ``examples/NAME.py`` as a module (without running its ``__main__`` block)."""
    path = EXAMPLES / f"{name}.py"
    module_name = f"attncomp_example_{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


def example_names() -> list[str]:
    return sorted(p.stem for p in EXAMPLES.glob("*.py") if not p.stem.startswith("_"))


#: the tests that call ``torch.compile``: one worker runs them all, so that Dynamo and Inductor start
#: once a run (a process's first compile took 10-14 s of the 2-core machine, a later one 1-3 s)
TORCH_COMPILE = pytest.mark.xdist_group("torch_compile")


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


def pytest_collection_modifyitems(session, config, items):
    """The long tests first (marked ``long``, the simulator's process first among them, and the
    context-parallel group behind its minute-long fixture): with one worker per core (``-n auto``),
    the rest of the suite runs beside them instead of after them. At the end of the list, the
    fixed-seed fuzz slice (a minute) kept one worker busy while the other sat idle (40-44 s a run
    on the 2-core machine)."""

    def later(item) -> bool:
        return item.get_closest_marker("long") is None and item.get_closest_marker("xdist_group") is None

    items.sort(key=later)


#: the collector's first threshold in a test process (Python's is 700): a collection of the young
#: generation walks what the young objects refer to, and a test's compiles and float64 references
#: make millions of objects: at 700 the bf16 and mixed-precision files spent 13% of their time
#: collecting (117.7 s in one process; 109.6 s at 20,000; the older generations' thresholds as Python's)
YOUNG_OBJECTS = 20_000


def pytest_configure(config):
    """The young generation collected in larger batches (:data:`YOUNG_OBJECTS`) from the start."""
    import gc

    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_OBJECTS, middle, old)


def pytest_collection_finish(session):
    """What the test modules imported (torch, transformers, dask, Numba: millions of objects) moved
    out of the cyclic garbage collector's sight: each full collection walked all of them again,
    some 15% of the fixed-seed fuzz slice in a worker that had collected the whole suite.  Only
    the objects the tests make are collected, as before."""
    import gc

    gc.collect()
    gc.freeze()


def pytest_unconfigure(config):
    """Everything out of the cyclic garbage collector's sight at the end of a test process, without
    a last full collection: pytest collects five times as it ends (reporting what garbage's
    finalisers raise), each walking all a process made (compiled kernels, their modules), some 10 s
    of each worker at the end of a run; one full collection of our own instead still took 2.6 s in
    one worker and more than 10 s in the other, whose process pytest-xdist then killed after
    waiting its 10 s, all of it at the end of the run with nothing beside it.  What the tests drop
    is collected during the run as before, where pytest reports what its finalisers raise; what is
    left at the end stays uncollected, as garbage does when a process exits."""
    import gc

    gc.freeze()
