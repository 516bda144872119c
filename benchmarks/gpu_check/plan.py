"""The plan of a run as data: the phases in order, their time limits, the files they write, and what
each one runs."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: every file a run writes into OUT_DIR, the summary first
FILES = (
    "summary.md",
    "environment.log",
    "gate.log",
    "correctness.log",
    "correctness.tsv",
    "compile.log",
    "timings.log",
    "sanitizer.log",
)
#: a log is cut to this many bytes (its head and its tail kept): every file stays under 16 MB
LOG_BYTES = 8 * 2**20
MAX_FILE_BYTES = 16 * 2**20

PHASES = ("environment", "gate", "correctness", "compile", "timings", "sanitizer")
#: the default deadline of the whole run, in seconds (``--deadline``)
DEADLINE = 480.0
#: each phase's time limit in seconds (``--limit PHASE=SECONDS`` changes one). They add up to 465 s:
#: with ``RESERVE`` that leaves 10 s of the 480 s deadline for starting and stopping processes (a
#: run on an H200 spent under 1 s). The correctness phase (every GPU test, kernels compiled cold)
#: gets the largest share, though cold it cannot finish in any share (on an H100 it ran 236 tests in
#: 235 s: a second command runs the rest, ``--after``); the compile ahead and the timings get what
#: an H100 showed they need (the backward rows' compiles past 75 s, the forward table past 67 s with
#: compiles inline, compute-sanitizer past 60 s compiling its workload). When the run is late, a
#: phase gets its share of what is left, in proportion to its limit and the later phases'
#: (``Run.limit``): a phase that times out never takes the later phases' time.
LIMITS = {"environment": 15, "gate": 20, "correctness": 175, "compile": 110, "timings": 110, "sanitizer": 35}
#: seconds kept back from the deadline for writing the summary
RESERVE = 5
#: seconds to wait for a killed process to go (one stuck in the driver is then left, not waited on)
KILL_WAIT = 5.0

#: the gate: the warp instructions against their documented fragment layouts (``warp.py``)
GATE_FILES = (
    "tests/cuda_sim/test_sim_tensor_cores.py",
    "tests/cuda_sim/test_sim_tf32.py",
    "tests/cuda_sim/test_sim_bf16_pool.py",
    "tests/cuda_sim/test_sim_copies.py",
)
GATE_KEYWORDS = (
    "documented_layout or quad_reductions_and_packing or tf32_round_and_split or rounding_to_bf16_on_the_device"
    " or ldmatrix_places or ldmatrix_gives_b_fragments"
)
#: the hardware's own tests first (the torch op on CUDA tensors, Hugging Face, determinism, bf16
#: training), then the simulator's matrix on the GPU: a phase cut short has run those first
CORRECTNESS = ("tests/gpu", "tests/cuda_sim")
#: the dry run's correctness phase: a handful of the simulator's tests (a split merge, a bf16
#: tensor-core example, a gradient), so that the phase's own code runs on every commit in seconds
DRY_RUN_CORRECTNESS = (
    "tests/cuda_sim/test_sim_decoding.py::test_rows_without_visible_keys_stay_zero_across_splits",
    "tests/cuda_sim/test_sim_tensor_cores.py::test_example_on_tensor_cores[alibi.causal_alibi-bf16]",
    "tests/cuda_sim/test_sim_gradients.py::test_alibi_slopes_get_their_gradient",
)
#: a test running longer than this is reported (pytest-timeout, where installed, fails it)
PER_TEST_SECONDS = 120
#: the slowest tests of the correctness phase the summary lists (with their seconds): where a cold
#: phase's time goes, kept in the committed summary
SLOWEST_LISTED = 12
#: the timing tables, in order, and their shares of the phase's time
TABLES = {"tensor_cores": 0.35, "training": 0.3, "decoder": 0.15, "serving": 0.2, "flash_attn": 0.1, "flex": 0.1}
#: the least time a table is started with (seconds): the flex table compiles PyTorch's FlexAttention in
#: its process (its kernels cached by the compile phase, its tracing not), so it is skipped, not cut
#: short, where the earlier tables left it less
MIN_TABLE_SECONDS = {"flex": 40.0}
#: the serving rows run at their quick sizes (8 sequences sharing a 1,024-token prompt, 16 ragged
#: ones up to 1,024): the full sizes' host-side set-up alone does not fit the table's share
SERVING_QUICK = True

DISTRIBUTIONS = (
    "numpy",
    "numba",
    "numba-cuda",
    "llvmlite",
    "ml_dtypes",
    "networkx",
    "scipy",
    "torch",
    "transformers",
    "cuda-bindings",
    "cuda-toolkit",
    "nvidia-nvjitlink",
    "pytest",
    "pytest-xdist",
    "pytest-timeout",
    "hypothesis",
)
#: what the command needs beyond the package's own dependencies, and what only helps
NEEDED = ("numba-cuda", "torch", "pytest")
OPTIONAL = ("transformers", "pytest-xdist", "pytest-timeout", "hypothesis", "cuda-toolkit", "nvidia-nvjitlink")

#: faults of an installation that the environment phase recognises in the error of compiling a
#: trivial kernel, and what to do about each
KNOWN_FAULTS = {
    "has no attribute 'row_stack'": (
        "numba-cuda 0.30.4 and older use numpy.row_stack, which numpy 2.5 removed: install numpy < 2.5 "
        "beside it (on a machine without a package index, carry the wheel)"
    ),
}
