"""``backends/front_end.py``: what attncomp changes in Numba's front end makes the same code.

The one-pass SSA reconstruction (``ssa_fix``) makes, statement for statement and phi for phi, the
blocks Numba's own makes, in a cpu task and in CUDA kernels; the lifetimes computed on demand
(``lazy_lifetimes``) and the closure inliner left out where it finds nothing (``closure_inlining``)
give a cpu task the same LLVM IR and a CUDA kernel the same PTX as Numba's eager post-processor and
its inliner; outside attncomp's compile window Numba's own passes run.
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import re

import numpy as np
import pytest
from numba import njit

import attncomp as ac
from attncomp.backends import (
    call_types,
    closure_inlining,
    front_end,
    function_passes,
    lazy_lifetimes,
    markup,
    ssa_fix,
)
from tests.conftest import load_example
from tests.passes import specs as pass_specs

CUDA = pytest.mark.skipif(importlib.util.find_spec("numba_cuda") is None, reason="needs the cuda extra")


def _cpu_task():
    """The causal spec's cpu task (a dispatcher) and its one signature."""
    fn = ac.compile(pass_specs.causal, backend="cpu")
    x = np.ones((1, 2, 5, 8), np.float32)
    fn(x, x, x)
    (task,) = [k for k in fn.compilation.program.kernels if k.py_func.__name__.endswith("_task")]
    return task, task.signatures[0]


def _recompiled(task, signature):
    """``task``'s function compiled again inside the window (not loaded from Numba's cache)."""
    options = {k: v for k, v in task.targetoptions.items() if k not in ("cache", "nopython")}
    again = njit(**options)(task.py_func)
    with call_types.remembered():
        again.compile(signature)
    return again


def _plain(code: str) -> str:
    """Code without the numbers Numba gives functions, shared arrays and inlined blocks by the
    process's compiles (blocks numbered in the order they first appear)."""
    code = re.sub(r"_cudapy_smem_\d+", "_cudapy_smem_", re.sub(r"B\d+v\d+", "B_v_", code))
    code = re.sub(r"_v\d+_", "_v_", code)
    labels: dict[str, str] = {}
    code = re.sub(r"\bB\d+\b", lambda m: labels.setdefault(m.group(0), f"B_{len(labels)}"), code)
    return re.sub(r"[ \t]+", " ", code)  # LLVM aligns comments after a label by its length


def _comparing_ssa(monkeypatch, module: str) -> list[tuple[int, int, bool]]:
    """Make ``module``'s SSA reconstruction run both and record (statements, phis, same)."""
    assert ssa_fix.install(module)
    replaced = ssa_fix.original(module)
    assert replaced is not None  # Numba's own, kept
    found = ssa_fix.pieces(module)
    compared = []

    def text(blocks):
        return [(label, [str(stmt) for stmt in block.body]) for label, block in blocks.items()]

    def both(blocks):
        theirs = text(replaced(copy.deepcopy(blocks)))  # a copy of the blocks, with its own scope
        ours = ssa_fix.run_ssa(found, blocks)
        phis = sum(str(stmt).count("phi(") for _, body in theirs for stmt in body)
        compared.append((sum(len(b) for _, b in theirs), phis, text(ours) == theirs))
        return ours

    monkeypatch.setattr(importlib.import_module(module), "_run_ssa", both)
    return compared


def test_the_one_pass_ssa_reconstruction_makes_numbas_blocks_in_a_cpu_task(monkeypatch):
    task, signature = _cpu_task()
    compared = _comparing_ssa(monkeypatch, "numba.core.ssa")
    _recompiled(task, signature)
    assert compared and all(same for _, _, same in compared), [c[:2] for c in compared if not c[2]]
    assert sum(p for _, p, _ in compared) > 10  # variables joined at phis


@CUDA
@pytest.mark.parametrize(
    "example, name, dtype, head_dim", [("causal", "causal", "bf16", 32), ("alibi", "causal_alibi", "f32", 64)]
)
def test_the_one_pass_ssa_reconstruction_makes_numba_cudas_blocks(monkeypatch, example, name, dtype, head_dim):
    """While an attention kernel compiles (bf16 on tensor cores; float32 on the scalar FMA kernel)."""
    from attncomp.backends import numba_cuda
    from attncomp.backends.numba_cuda.ptx import compile_ptx_for
    from tests.cuda_sim.helpers import retyped

    compared = _comparing_ssa(monkeypatch, "numba.cuda.core.ssa")
    spec = getattr(load_example(example), name)
    module = ac.compile(retyped(spec, dtype) if dtype != "f32" else spec, backend="interp").module
    impl = numba_cuda.build(module)
    kernel = next(k for k in impl.kernels(head_dim, head_dim) if k.name.startswith("attention_kernel_0["))
    compile_ptx_for(kernel.py_func, kernel.signature, [(8, 0)], kernel.launch_bounds)
    assert compared and all(same for _, _, same in compared), [c[:2] for c in compared if not c[2]]
    assert max(n for n, _, _ in compared) > 1000 and sum(p for _, p, _ in compared) > 50  # the kernel: many phis


def _numbas_own(monkeypatch, package: str) -> None:
    """Numba's own post-processor and closure inliner in ``package`` (``numba.core`` or
    ``numba.cuda.core``), inside the window too."""
    postproc, passes = f"{package}.postproc", f"{package}.untyped_passes"
    lazy_lifetimes.install(postproc)
    closure_inlining.install(passes)
    monkeypatch.setattr(importlib.import_module(postproc).PostProcessor, "run", lazy_lifetimes.original(postproc))
    inliner = importlib.import_module(passes).InlineClosureLikes
    monkeypatch.setattr(inliner, "run_pass", closure_inlining.original(passes))


def test_lifetimes_on_demand_and_no_inliner_give_a_cpu_task_the_same_llvm_ir(monkeypatch):
    front_end.install("cpu")
    task, signature = _cpu_task()
    assert closure_inlining.nothing_to_inline(task.py_func)
    ours = _recompiled(task, signature).inspect_llvm(signature)
    _numbas_own(monkeypatch, "numba.core")
    theirs = _recompiled(task, signature).inspect_llvm(signature)
    assert "define" in ours and _plain(ours) == _plain(theirs)


@CUDA
def test_lifetimes_on_demand_and_no_inliner_give_a_cuda_kernel_the_same_ptx(monkeypatch):
    from attncomp.backends import numba_cuda
    from attncomp.backends.numba_cuda.ptx import compile_ptx_for
    from tests.cuda_sim.helpers import retyped

    impl = numba_cuda.build(ac.compile(retyped(pass_specs.causal, "bf16"), backend="interp").module)
    kernel = next(k for k in impl.kernels(32, 32) if k.name.startswith("attention_kernel_0["))
    assert closure_inlining.nothing_to_inline(kernel.py_func)
    ours = compile_ptx_for(kernel.py_func, kernel.signature, [(8, 0)], kernel.launch_bounds)[(8, 0)]
    _numbas_own(monkeypatch, "numba.cuda.core")
    theirs = compile_ptx_for(kernel.py_func, kernel.signature, [(8, 0)], kernel.launch_bounds)[(8, 0)]
    assert "mma.sync" in ours and _plain(ours) == _plain(theirs)


def test_the_inliner_is_left_out_only_where_it_can_find_nothing():
    """A nested function, lambda or comprehension (a ``make_function``), an ``append``, and
    ``functools.reduce`` by its name or another, global or free, each keep Numba's inliner."""
    import functools

    fold = functools.reduce

    def plain(xs):
        total = 0.0
        for x in xs:
            total += x
        return total

    def comprehension(xs):
        return sum([x for x in xs])

    def appending(xs):
        out = []
        out.append(xs[0])
        return out

    def by_attribute(xs):
        return functools.reduce(min, xs)

    def free(xs):
        return fold(min, xs)

    def nested(xs):
        def twice(x):
            return 2 * x

        return twice(xs[0])

    def fold_global(xs):
        return folded(min, xs)  # noqa: F821 (a global of the copy below)

    by_global = type(fold_global)(fold_global.__code__, {"folded": functools.reduce})
    assert closure_inlining.nothing_to_inline(plain)
    for function in (comprehension, appending, by_attribute, free, nested, by_global):
        assert not closure_inlining.nothing_to_inline(function), function.__name__
    assert functools.reduce(min, [3, 1, 2]) == by_global([3, 1, 2]) == free([3, 1, 2]) == 1


def test_outside_the_window_numbas_own_passes_run(monkeypatch):
    """A user's own Numba function, compiled outside the window: the post-processor computes the
    variables live at each block's entry, and Numba's SSA reconstruction runs; inside, neither."""
    from numba.core import analysis

    front_end.install("cpu")
    counts = {"entry sets": 0, "one pass": 0}
    compute_live_variables = analysis.compute_live_variables
    run_ssa = ssa_fix.run_ssa

    def counted_entry_sets(*args):
        counts["entry sets"] += 1
        return compute_live_variables(*args)

    def counted_ssa(*args):
        counts["one pass"] += 1
        return run_ssa(*args)

    monkeypatch.setattr(analysis, "compute_live_variables", counted_entry_sets)
    monkeypatch.setattr(ssa_fix, "run_ssa", counted_ssa)

    def running(xs):
        total = 0.0
        for x in xs:
            if x > 0:
                total += x
            else:
                total -= 1.0
        return total

    xs = np.array([1.0, -2.0, 3.0])
    assert njit(running)(xs) == 3.0
    outside = dict(counts)
    counts.update({k: 0 for k in counts})
    with call_types.remembered():
        assert njit(running)(xs) == 3.0
    assert outside == {"entry sets": outside["entry sets"], "one pass": 0} and outside["entry sets"] > 0
    assert counts == {"entry sets": 0, "one pass": counts["one pass"]} and counts["one pass"] > 0


@pytest.mark.parametrize("module", ["numba.core.errors", "numba.cuda.core.errors"])
def test_messages_are_marked_up_as_numba_marks_them(monkeypatch, module):
    if module.startswith("numba.cuda") and importlib.util.find_spec("numba_cuda") is None:
        pytest.skip("needs the cuda extra")
    errors = importlib.import_module(module)
    if not hasattr(errors, "HighlightColorScheme"):
        pytest.skip("colorama is not installed: Numba marks nothing up")
    front_end.install("cpu" if module == "numba.core.errors" else "cuda")
    scheme = errors.HighlightColorScheme(errors.themes["dark_bg"])

    def texts():
        plain = scheme._markup("w", None, None)
        return [scheme.errmsg("refused"), scheme.code("x + y"), scheme.filename("f.py"), plain]

    outside = texts()
    assert outside[0] != "refused"  # coloured
    monkeypatch.setattr(errors, "ColorShell", None)  # inside the window, no shell is made
    with call_types.remembered():
        assert texts() == outside


@CUDA
def test_the_cuda_front_end_marks_up_numbas_own_messages_too(monkeypatch):
    """numba-cuda builds some of a kernel's messages through Numba's core (``typeof``)."""
    installed: list[str] = []
    monkeypatch.setattr(markup, "install", installed.append)
    front_end.install("cuda")
    assert installed == ["numba.cuda.core.errors", "numba.core.errors"]


def test_numbas_llvm_passes_per_function_run_outside_the_window_only(monkeypatch):
    """Inside the window the final module's pipelines optimise a function (``function_passes``)."""
    from numba.core import codegen

    front_end.install("cpu")
    assert function_passes.original() is not None
    made = []
    real = codegen.CPUCodegen._function_pass_manager

    def counted(self, **options):
        made.append(1)
        return real(self, **options)

    monkeypatch.setattr(codegen.CPUCodegen, "_function_pass_manager", counted)

    def total(xs):
        s = 0.0
        for x in xs:
            s += x
        return s

    xs = np.arange(5.0)
    assert njit(total)(xs) == 10.0
    outside = len(made)
    with call_types.remembered():
        assert njit(total)(xs) == 10.0
    assert outside > 0 and len(made) == outside
