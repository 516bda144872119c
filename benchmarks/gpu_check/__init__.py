"""Everything a GPU machine can tell about attncomp, in one command and one folder.

    python -m benchmarks.gpu_check OUT_DIR               # on a GPU machine, from a checkout
    python -m benchmarks.gpu_check --dry-run OUT_DIR     # the same phases under Numba's CUDA simulator

Runs, in order, each phase in its own subprocesses with its own time limit (a hung kernel takes its
phase, not the rest), within an overall deadline (``--deadline``, 480 s by default):

- **environment**: the GPU (name, compute capability, driver), the versions of numba, numba-cuda,
  torch, transformers, ml_dtypes and the rest against ``pyproject.toml``'s minimums, what is missing;
- **gate**: the tests that hold the warp instructions to their documented fragment layouts (mma in
  f16, bf16 and tf32, the quad shuffles, packing, the tf32 split, bf16 rounding); if it fails, the
  timings that rely on those instructions are skipped;
- **correctness**: ``ATTNCOMP_TEST_GPU=1 pytest tests/cuda_sim tests/gpu``, one xdist worker per core,
  a junit file of the results;
- **compile**: one untimed call of every benchmark row at its size, in parallel processes, so that the
  kernel cache holds every kernel before anything is timed;
- **timings**: the tables of ``benchmarks.tensor_cores`` and ``benchmarks.tensor_core_training`` and
  the decoder and serving rows of ``benchmarks.gpu``, with TFLOP/s and GB/s against the card's
  datasheet peaks (``cards.CARDS``);
- **sanitizer**, if time is left: ``compute-sanitizer`` racecheck and synccheck over a small bf16
  forward, backward and decoding step.

``OUT_DIR`` receives at most eight files, each under 16 MB: ``summary.md`` first (the verdict, the
card, a line per phase, then the tables), then the logs.  The dry run runs the same phases at tiny
sizes under the simulator (the gate's layout tests, a handful of the correctness tests, the compile
of a few rows), and reports the timings and the sanitizer as skipped, with the reason.

The modules: ``plan`` (the phases, their limits, the files, what each runs), ``cards`` (the known
cards' peaks), ``environment`` (what the machine has), ``run`` (one run's clock and records),
``processes`` (starting and stopping the subprocesses), ``phases`` (the phase runners), ``workers``
(what runs inside the subprocesses), ``summary`` (the verdict and ``summary.md``), ``cli`` (the
command line).
"""
