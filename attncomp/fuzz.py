"""Differential fuzzing of the whole compiler.

    python -m attncomp.fuzz --cases 10000 --seed 0            # interpreter, every stage
    python -m attncomp.fuzz --cases 300 --seed 1 --cpu-every 25
    python -m attncomp.fuzz --cases 300 --seed 2 --paths-every 1   # chunked, decoded, paged too
    NUMBA_ENABLE_CUDASIM=1 python -m attncomp.fuzz --cases 100 --cuda-every 5   # CUDA simulator

Hypothesis draws random specs from a grammar of score modifications (scales,
per-head biases from a captured tensor, soft-capping, a relative-position
table, an additive bias tensor, a sigmoid gate of the scores, and gathers that may leave their table: an unclamped
relative position, two slopes read by every head, a table read at document ids) and
masks (affine conditions on i and j
combined with & | ~, key lengths, document ids and tables of blocks from captured tensors),
random sizes (not multiples of the blocks, single rows, rows that see no
key), random pipelines, and a third of the cases sigmoid attention (``ac.sigmoid(s) @ v``, no
softmax).  Where the reference interpreter raises ``IndexError``
(a gather out of range), every stage and backend must raise it too, naming the
same axis, size and index.  Otherwise each case runs the reference interpreter on the
traced graph and on the IR after every pass, checks the gradients (the
unfused graph's against finite differences, then every stage of the backward
and each backend's pullback against those), and, every ``--cpu-every``
cases, the CPU backend (a new spec is a new Numba compile, seconds each, so
the backend sees a sample), and every ``--cuda-every`` cases the CUDA backend
(on a GPU, or in Numba's simulator at these tiny sizes); every ``--paths-every`` cases, the
paths that split a spec's sequence (a chunked run, the decoder and the paged decoder,
:mod:`attncomp.fuzz_paths`).  A mismatch is shrunk by Hypothesis and printed
as a spec file that reproduces it.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import sys
import tempfile
import textwrap
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

import attncomp as ac
from attncomp.fuzz_paths import run_paths
from attncomp.ir.types import NUMPY_DTYPES
from attncomp.testing import TOLERANCE, directional_derivatives, interpret_float64, worst_error

BLOCKS = [(4, 4), (4, 8), (8, 4), (16, 16), (64, 64)]
#: the pipeline of a bf16 case drawn without one: an unfused bf16 graph stores every intermediate in
#: bf16, as eager frameworks do, so its error against the float64 meaning grows with the spec's own
#: conditioning (bf16 scores scaled by 25: 0.22 relative, seed 20261201) and no bound fits the type;
#: fused, the scores are computed in float32 from the bf16 inputs and rounded once (0.0036 there)
BF16_UNFUSED = "softmax-fusion"

SCORE_MODS = {
    "scale": "s = s * {c}",
    "alibi": "s = s + slopes[h] * (j - i)",
    "softcap": "s = {c} * ac.tanh(s / {c})",
    "relative": "s = s + table[ac.minimum(ac.maximum(i - j + 3, 0), 6)]",
    "bias": "s = s + bias[b, h, i, j]",
    "gated": "s = s * ac.sigmoid(s - {c})",
    # gathers that leave their source for some sizes or inputs
    "unclamped": "s = s + table[i - j + {n}]",
    "two_slopes": "s = s + two[h] * (j - i)",
    "by_document": "s = s + table[doc[b, i] + {n}]",
}
AFFINE_ATOMS = [
    "j <= i + {c}",
    "i - j < {w}",
    "j >= {c}",
    "j < i + {w}",
    "(i // 4) == (j // 4)",
    "j > i - {w}",
    "j <= i + s.shape[-1] - s.shape[-2] + {c}",  # aligned to the last query, as FlashAttention's causal
]
DATA_ATOMS = {"lengths": "j < lengths[b]", "doc": "doc[b, i] == doc[b, j]"}
#: a table of blocks of {r} queries by {c} keys (FlexAttention's block lists), its shape read from the first
BLOCKS_ATOM = "blocks[h, i // {r}, j // {c}] > 0"
_BLOCKS = re.compile(r"blocks\[h, i // (\d+), j // (\d+)\]")
_SCALED = re.compile(r"s = s \* (-?[0-9.]+)")
#: the largest :attr:`Case.gain`: float32 bounds reach 2e-2, well under the errors of a wrong result
MOST_GAIN = 200.0


@dataclass
class Case:
    """One random spec, its sizes and the pipeline it is compiled with."""

    score: list[str]
    mask: str | None
    sizes: dict[str, int]
    pipeline: str
    constants: dict[str, float] = field(default_factory=dict)
    lse: bool = False
    #: the spec also returns each row's max score (``ac.max(s, axis=-1)``), after the output
    top: bool = False
    #: the float type of q, k, v and the float tables (the CPU slice also runs each case in bf16)
    dtype: str = "f32"
    #: sigmoid attention, ``ac.sigmoid(s) @ v`` (masked scores -inf: weights 0), instead of the softmax
    sigmoid: bool = False

    @property
    def gain(self) -> float:
        """How much a float32 bound grows with the score mods' scales: their product's magnitude, from 1
        to :data:`MOST_GAIN`.  float32's rounding of a score is amplified in the probabilities and
        once more in the gradients: on the cpu, scores scaled by 30 gave gradients within 5.2e-4 of
        the float64 ones, by 3 within 4.4e-5, unscaled 1.8e-5 (59 inputs each); by 900, 4,500 and
        27,000, within 2.3e-4, 1.7e-3 and 5.4e-3 (29 each), the outputs within 1.4e-5."""
        gain = 1.0
        for line in self.score:
            scaled = _SCALED.fullmatch(line)
            if scaled:
                gain *= abs(float(scaled.group(1)))
        return min(max(gain, 1.0), MOST_GAIN)

    @property
    def captured(self) -> list[str]:
        text = "\n".join(self.score) + (self.mask or "")
        return [name for name in ("slopes", "two", "table", "bias", "lengths", "doc", "blocks") if name + "[" in text]

    def source(self) -> str:
        args = {
            "slopes": 'slopes: ac.f32["H"]',
            "two": "two: ac.f32[2]",
            "table": "table: ac.f32[7]",
            "bias": 'bias: ac.f32["B", "H", "T", "S"]',
            "lengths": 'lengths: ac.i32["B"]',
            "doc": 'doc: ac.i32["B", "T"]',
            "blocks": 'blocks: ac.i32["H", "QB", "KB"]',
        }
        params = ['q: ac.f32["B", "H", "T", "D"]', 'k: ac.f32["B", "H", "S", "D"]', 'v: ac.f32["B", "H", "S", "D"]']
        params += [args[name] for name in self.captured]
        params = [p.replace("ac.f32", f"ac.{self.dtype}") for p in params]
        body = ["s = (q @ k.mT) * q.shape[-1] ** -0.5", "b, h, i, j = ac.index(s)", *self.score]
        if self.mask:
            body.append(f"s = ac.where({self.mask}, s, -ac.inf)")
        results = ["ac.sigmoid(s) @ v" if self.sigmoid else "ac.softmax(s, axis=-1) @ v"]
        results += ["ac.max(s, axis=-1)"] * self.top + ["ac.logsumexp(s, axis=-1)"] * self.lse
        body.append(f"return {', '.join(results)}")
        signature = ",\n    ".join(params)
        return (
            "# ruff: noqa: F821\nimport attncomp as ac\n\n\n@ac.spec\n"
            f"def fuzzed(\n    {signature},\n):\n" + textwrap.indent("\n".join(body), "    ") + "\n"
        )

    def inputs(self, seed: int) -> list[np.ndarray]:
        rng = np.random.default_rng(seed)
        B, H, T, S, D = (self.sizes[n] for n in "BHTSD")
        arrays = [rng.standard_normal(shape).astype(np.float32) for shape in ((B, H, T, D), (B, H, S, D), (B, H, S, D))]
        makers = {
            "slopes": lambda: rng.uniform(0.0, 0.5, H).astype(np.float32),
            "two": lambda: rng.uniform(0.0, 0.5, 2).astype(np.float32),
            "table": lambda: rng.standard_normal(7).astype(np.float32),
            "bias": lambda: rng.standard_normal((B, H, T, S)).astype(np.float32),
            "lengths": lambda: rng.integers(0, S + 1, B).astype(np.int32),
            "doc": lambda: np.sort(rng.integers(0, 3, (B, T)), axis=1).astype(np.int32),
            "blocks": lambda: rng.integers(0, 2, (H, -(-T // rows), -(-S // cols))).astype(np.int32),
        }
        rows, cols = (int(n) for n in _BLOCKS.search(self.source()).groups()) if "blocks" in self.captured else (1, 1)
        arrays += [makers[name]() for name in self.captured]
        return [a.astype(NUMPY_DTYPES[self.dtype]) if a.dtype == np.float32 else a for a in arrays]


def load_case(case: Case, directory: Path) -> ac.Spec:
    path = directory / f"fuzzed_{abs(hash(case.source()))}.py"
    path.write_text(case.source())
    loader = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(module)
    return module.fuzzed


def _as_list(result) -> list[np.ndarray]:
    return list(result) if isinstance(result, tuple) else [result]


def run_case(
    case: Case, directory: Path, backends: tuple[str, ...] = ("interp",), seed: int = 0, gradients: bool = True
) -> str | None:
    """None when every stage and backend agrees with the reference; else what differed.

    With ``gradients``, also the backward: the unfused graph's gradients against
    finite differences, every stage of the backward IR against them, and each
    backend's pullback.
    """
    spec = load_case(case, directory)
    inputs = case.inputs(seed)
    try:
        reference = _as_list(ac.interpret(spec, *inputs))
    except IndexError as error:
        return _check_index_error(spec, case.pipeline, inputs, backends, str(error))
    grads = _reference_gradients(spec, inputs, seed, case.top, case.gain) if gradients else None
    if isinstance(grads, str):
        return grads
    for backend in backends:
        fn = ac.compile(spec, backend=backend, pipeline=case.pipeline)
        if backend == "interp":
            for stage in fn.stages:
                got = _as_list(ac.interpret(ac.parse_ir(fn.ir(stage)), *inputs))
                error = worst_error(got, reference)
                if error > 1e-9:
                    return f"interpreting the IR after {stage}: relative error {error:.3e}"
        error = worst_error(_as_list(fn(*inputs)), reference)
        if error > (1e-4 * case.gain if case.dtype == "f32" else TOLERANCE[case.dtype]):
            return f"backend {backend}: relative error {error:.3e} ({case.dtype})"
        if grads is not None:
            problem = _check_backward(fn, inputs, *grads, bound=1e-4 * case.gain)
            if problem is not None:
                return f"backend {backend}: {problem}"
    return None


_GATHER_ERROR = re.compile(
    r"ac\.gather: (?:an )?index (?:may reach )?(-?\d+),? (?:is )?out of range for axis (\d+) of size (\d+)"
)


def gather_error(message: str) -> tuple[int, int, int] | None:
    """(index, axis, size) of an out-of-range gather's message, whichever stage or backend raised it."""
    found = _GATHER_ERROR.search(message)
    return None if found is None else (int(found[1]), int(found[2]), int(found[3]))


def _check_index_error(
    spec: ac.Spec, pipeline: str, inputs: list[np.ndarray], backends: tuple[str, ...], message: str
) -> str | None:
    """Every stage and backend raises the interpreter's ``IndexError`` (the same index, axis and size)."""
    want = gather_error(message)
    if want is None:
        return f"the interpreter raised an IndexError that names no gather: {message}"
    for backend in backends:
        fn = ac.compile(spec, backend=backend, pipeline=pipeline)
        runs = [
            (f"backend {backend}", lambda fn=fn: fn(*inputs)),
            (f"backend {backend} vjp", lambda fn=fn: fn.vjp(*inputs)),
        ]
        if backend == "interp":
            runs += [
                (
                    f"interpreting the IR after {stage}",
                    lambda stage=stage, fn=fn: ac.interpret(ac.parse_ir(fn.ir(stage)), *inputs),
                )
                for stage in fn.stages
            ]
        for what, run in runs:
            try:
                run()
            except IndexError as error:
                if gather_error(str(error)) != want:
                    return f"{what}: raised {error!s} where the interpreter raised {message}"
                continue
            return f"{what}: no IndexError where the interpreter raised {message}"
    return None


def _reference_gradients(spec: ac.Spec, inputs: list[np.ndarray], seed: int, top: bool = False, gain: float = 1.0):
    """(cotangents, gradients) of the unfused graph, checked against finite differences (within 1e-5 times
    the case's ``gain``: a central difference's error grows with the scores' scale too); or what differed."""
    rng = np.random.default_rng(seed + 1)
    out, pullback = ac.compile(spec, backend="interp", pipeline="").vjp(*inputs)
    cotangents = [rng.standard_normal(np.shape(o)) for o in _as_list(out)]
    if top:  # each row's max score (the second result) passes no gradient: its cotangent is zero
        cotangents[1] = np.zeros_like(cotangents[1])
    grads = pullback(*cotangents)
    directions = [rng.standard_normal(np.shape(a)) if g is not None else None for a, g in zip(inputs, grads)]
    numeric = directional_derivatives(spec.ir.main, inputs, cotangents, directions)
    for k, (g, d, expected) in enumerate(zip(grads, directions, numeric)):
        if d is not None:
            got = float(np.sum(g * d))
            if abs(got - expected) > 1e-5 * gain * max(abs(expected), 1e-2):
                return f"gradient of argument {k}: {got} against finite differences {expected}"
    return cotangents, grads


def _check_backward(
    fn: ac.CompiledFunction, inputs: list[np.ndarray], cotangents, expected, bound: float = 1e-4
) -> str | None:
    """The backward's stages (interp, to 1e-9) or a backend's pullback (to ``bound``) against ``expected``."""
    want = [g for g in expected if g is not None]
    if fn.backend == "interp":
        saving = fn.forward_saving
        outputs = interpret_float64(saving.func, inputs)
        saved = outputs[len(outputs) - saving.func.attrs.get("residuals", 0) :]
        backward = fn.backward
        for stage in backward.stages[backward.stages.index("autodiff") :]:
            got = interpret_float64(ac.parse_ir(backward.ir(stage)).main, [*inputs, *saved, *cotangents])
            error = gradient_error(got, want)
            if error > 1e-9:
                return f"interpreting the backward after {stage}: relative error {error:.3e}"
        return None
    dtypes = [np.float32 if np.shape(c) else np.float64 for c in cotangents]
    got = fn.vjp(*inputs)[1](*(np.asarray(c, dtype=t) for c, t in zip(cotangents, dtypes)))
    error = gradient_error([g for g in got if g is not None], want)
    return None if error <= bound else f"gradients: relative error {error:.3e}"


def gradient_error(got: list[np.ndarray], want: list[np.ndarray]) -> float:
    """Largest difference over the largest gradient of all arguments (at least 1e-6: zero gradients
    of a single key or a fully masked row compare with rounding noise)."""
    flat_got = np.concatenate([np.ravel(np.asarray(g, dtype=np.float64)) for g in got] + [np.zeros(0)])
    flat_want = np.concatenate([np.ravel(np.asarray(w, dtype=np.float64)) for w in want] + [np.zeros(0)])
    if not np.all(np.isfinite(flat_got)):
        return float("inf")
    scale = max(float(np.max(np.abs(flat_want), initial=0.0)), 1e-6)
    return float(np.max(np.abs(flat_got - flat_want), initial=0.0)) / scale


def strategies():
    """The Hypothesis strategy of cases (imported lazily: hypothesis is a test dependency)."""
    from hypothesis import strategies as st

    constant = st.sampled_from([0.5, 2.0, 5.0, 30.0])
    small = st.integers(0, 6)
    atom = st.one_of(
        st.builds(lambda t, c, w: t.format(c=c, w=w + 1), st.sampled_from(AFFINE_ATOMS), small, small),
        st.sampled_from(["lengths", "doc"]).map(lambda k: DATA_ATOMS[k]),
        st.builds(lambda r, c: BLOCKS_ATOM.format(r=r, c=c), *[st.sampled_from([1, 2, 3, 4, 8, 16])] * 2),
    )
    mask = st.recursive(
        atom,
        lambda inner: st.one_of(
            st.builds(lambda a, b: f"({a}) & ({b})", inner, inner),
            st.builds(lambda a, b: f"({a}) | ({b})", inner, inner),
            inner.map(lambda a: f"~({a})"),
        ),
        max_leaves=3,
    )
    offset = st.integers(0, 8)
    score = st.lists(st.sampled_from(sorted(SCORE_MODS)), max_size=3).flatmap(
        lambda names: st.tuples(*[st.tuples(constant, offset) for _ in names]).map(
            lambda cs: [SCORE_MODS[n].format(c=c, n=o) for n, (c, o) in zip(names, cs)]
        )
    )
    sizes = st.fixed_dictionaries(
        {
            "B": st.integers(1, 2),
            "H": st.integers(1, 3),
            "T": st.integers(1, 19),
            "S": st.integers(1, 19),
            "D": st.sampled_from([2, 4, 8]),
        }
    )
    pipeline = st.one_of(
        st.just(""),
        st.just("softmax-fusion"),
        st.sampled_from(BLOCKS).map(lambda b: f"cse,softmax-fusion,flash-tiling{{block_q={b[0]},block_k={b[1]}}}"),
        st.sampled_from(BLOCKS).map(
            lambda b: (
                f"cse,softmax-fusion,flash-tiling{{block_q={b[0]},block_k={b[1]}}},mask-elimination,"
                "canonicalize,cse,dce"
            )
        ),
    )

    def fix(case: Case) -> Case:
        if "doc[" in (case.mask or "") + "".join(case.score):  # document ids index both axes: self-attention
            case.sizes["S"] = case.sizes["T"]
        if case.sigmoid:  # its weights have no log-sum-exp or max of their own
            case.lse = case.top = False
        return case

    return st.builds(
        lambda sc, m, sz, p, lse, top, sig: fix(Case(sc, m, dict(sz), p, lse=lse, top=top, sigmoid=sig)),
        score,
        st.one_of(st.none(), mask),
        sizes,
        pipeline,
        st.booleans(),
        st.booleans(),
        st.sampled_from([False, False, True]),  # a third of the cases are sigmoid attention
    )


def fuzz(
    cases: int,
    seed: int,
    cpu_every: int = 0,
    verbose: bool = False,
    cuda_every: int = 0,
    paths_every: int = 0,
    paths_backend: str = "interp",
) -> int:
    """Run ``cases`` random cases; returns the number that ran.  Raises on a mismatch.

    Every ``paths_every`` cases the case also runs chunked, decoded and paged
    (:mod:`attncomp.fuzz_paths`) on ``paths_backend``."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as hypothesis_seed

    count = [0]
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)

        @hypothesis_seed(seed)
        @settings(
            max_examples=cases, deadline=None, database=None, derandomize=False, suppress_health_check=list(HealthCheck)
        )
        @given(strategies())
        def check(case: Case) -> None:
            count[0] += 1
            backends = ("interp",)
            if cpu_every and count[0] % cpu_every == 0:
                backends += ("cpu",)
            if cuda_every and count[0] % cuda_every == 0:
                backends += ("cuda",)
            problem = run_case(case, directory, backends, seed=count[0])
            if problem is None and paths_every and count[0] % paths_every == 0:
                bound = 1e-5 if paths_backend == "interp" else 1e-4 * case.gain  # float32's grows with the scales
                problem = run_paths(case, lambda c: load_case(c, directory), count[0], paths_backend, bound)
            if problem is None and "cpu" in backends:  # the same case in bf16 (no finite differences there)
                case = replace(case, dtype="bf16", pipeline=case.pipeline or BF16_UNFUSED)
                problem = run_case(case, directory, ("cpu",), seed=count[0], gradients=False)
            if verbose:
                print(f"case {count[0]}: {'ok' if problem is None else problem}", file=sys.stderr)
            if problem is not None:
                raise AssertionError(
                    f"{problem}\npipeline: {case.pipeline!r}\nsizes: {case.sizes}\n--- spec file ---\n{case.source()}"
                )

        check()
    return count[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m attncomp.fuzz", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cases", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cpu-every", type=int, default=0, metavar="N", help="also run the CPU backend every N cases")
    parser.add_argument(
        "--cuda-every",
        type=int,
        default=0,
        metavar="N",
        help="also run the CUDA backend every N cases (a GPU, or NUMBA_ENABLE_CUDASIM=1 for the simulator)",
    )
    parser.add_argument(
        "--paths-every",
        type=int,
        default=0,
        metavar="N",
        help="also run every N-th case chunked (Dask), decoded and paged",
    )
    parser.add_argument(
        "--paths-backend",
        default="interp",
        choices=["interp", "cpu", "cuda"],
        help="the backend those paths run on (default: the interpreter; a compiled one compiles each case's parts)",
    )
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    ran = fuzz(
        args.cases, args.seed, args.cpu_every, args.verbose, args.cuda_every, args.paths_every, args.paths_backend
    )
    print(f"{ran} cases, 0 mismatches (seed {args.seed})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
