"""What runs inside the subprocesses (``python -m benchmarks.gpu_check --worker KIND``): each worker
prints its log and writes its results as JSON records (``processes.emit``) for the phase to read."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from benchmarks.gpu_check.environment import probe
from benchmarks.gpu_check.plan import SERVING_QUICK
from benchmarks.gpu_check.processes import emit


def tiny(row):
    """A benchmark row at the dry run's size (the same spec, type, mask and pipeline)."""
    return dataclasses.replace(row, name=f"{row.name} [dry run: B=1 H=1 T=S=16 D=16]", b=1, h=1, t=16, d=16)


def simulated_row(row, backward: bool) -> None:
    """A row's call (and gradient) on numpy arrays in the simulator: its kernels, at a tiny size."""
    import ml_dtypes
    import numpy as np

    import attncomp as ac

    dtype = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}[row.dtype]
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((row.b, row.h, row.t, row.d)).astype(dtype) for _ in range(3))
    fn = ac.compile(row.spec, backend="cuda", pipeline=row.pipeline(), **row.constants)
    if backward:
        out, pullback = fn.vjp(q, k, v)
        pullback(np.ones(np.shape(out), dtype))
    else:
        fn(q, k, v)


def simulated_decoder() -> None:
    import numpy as np

    import attncomp as ac
    from benchmarks import specs

    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, 4, 16, 16)).astype(np.float32)
    k, v = (rng.standard_normal((1, 2, 16, 16)).astype(np.float32) for _ in range(2))
    for cache in (None, "f8e4m3"):
        dec = ac.compile(specs.gqa_decode, backend="cuda").decoder(max_len=16, cache=cache)
        dec(q[:, :, :-1], k[:, :, :-1], v[:, :, :-1])
        dec(q[:, :, -1:], k[:, :, -1:], v[:, :, -1:])
    print("compiled: decoder steps over a float32 and an f8e4m3 cache [dry run: GQA 4/2 D=16, 16 cached]")


def worker_compile(args: argparse.Namespace) -> None:
    from benchmarks import tensor_core_training, tensor_cores

    table, _, index = args.job.partition(":")
    modules = {"tensor_cores": tensor_cores, "training": tensor_core_training}
    result = Path(args.result)
    if args.dry_run:
        if table == "decoder":
            simulated_decoder()
        else:
            row = tiny(modules[table].rows(args.quick)[int(index)])
            simulated_row(row, backward=table == "training")
            print(f"compiled: {row.name}")
        emit(result, {"status": "passed"})
        return
    from benchmarks.gpu import gpu_or_reason

    reason = gpu_or_reason()
    if reason is not None:
        emit(result, {"status": "skipped", "note": reason})
        return
    import torch

    if table in modules:
        row = modules[table].rows(args.quick)[int(index)]
        modules[table].warm_row(torch, row)
        print(f"compiled: {row.name}")
    elif table == "decoder":
        from benchmarks.gpu import bf16_decode_row, decoder_step_row, fp8_decoder_step_row

        print(decoder_step_row(torch, True, 1))  # the quick size's kernels are the full size's
        print(bf16_decode_row(torch, True, 1))
        print(fp8_decoder_step_row(torch, True, 1))
    elif table == "serving":
        from benchmarks import serving

        for line in serving.serving_rows(True, 1, backend="cuda"):
            print(line)
    elif table == "flash_attn":
        from benchmarks import flash_attn

        print(flash_attn.warm("cuda", args.quick))
    elif table == "flex":
        from benchmarks import flex

        print(flex.warm("cuda", args.quick))
    elif table == "sanitize":
        print(sanitized_workload())
    emit(result, {"status": "passed"})


def worker_timings(args: argparse.Namespace) -> None:
    from benchmarks.gpu import gpu_or_reason

    result = Path(args.result)
    reason = gpu_or_reason()
    if reason is not None:
        if args.dry_run:
            reason = f"dry run: the tables time CUDA tensors against SDPA on a GPU ({reason})"
        emit(result, {"kind": "skipped", "reason": reason})
        return
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    table = args.job
    if table in ("tensor_cores", "training"):
        from benchmarks import tensor_core_training, tensor_cores

        module = tensor_cores if table == "tensor_cores" else tensor_core_training
        print(f"{table} on {torch.cuda.get_device_name()}, median of {args.repeats} calls", flush=True)
        for row in module.rows(args.quick):
            try:
                timing = module.measure_row(torch, row, args.repeats)
            except Exception as error:  # a wrong result or a failed launch: reported, the next row runs
                print(f"{row.name}: {type(error).__name__}: {error}", flush=True)
                emit(result, {"kind": "error", "name": row.name, "error": f"{type(error).__name__}: {error}"})
                continue
            finally:
                torch.cuda.empty_cache()
            print(timing.line(), flush=True)
            record = {"kind": "row", "name": row.name, "dtype": row.dtype, "precision": row.precision}
            fields = ("ms", "peer", "peer_ms", "ratio", "default", "default_ms", "default_ratio", "flops", "bytes")
            fields += ("kernel",)
            record.update({f: getattr(timing, f) for f in fields})
            emit(result, record)
    elif table == "decoder":
        from benchmarks.gpu import bf16_decode_row, decoder_step_row, fp8_decoder_step_row

        rows = (
            ("decoder step", decoder_step_row),
            ("bf16 decode step", bf16_decode_row),
            ("f8e4m3 decoder step", fp8_decoder_step_row),
        )
        for name, row in rows:
            try:
                line = row(torch, args.quick, args.repeats)
            except Exception as error:  # a wrong result or a failed launch: reported, the next row runs
                print(f"{name}: {type(error).__name__}: {error}", flush=True)
                emit(result, {"kind": "error", "name": name, "error": f"{type(error).__name__}: {error}"})
                continue
            print(line, flush=True)
            emit(result, {"kind": "line", "text": line})
        from benchmarks.host_profile import decode_profile_lines

        try:  # where the steps' time goes: logged whole; each case's first line and its launches in the summary
            profile = decode_profile_lines(torch, args.quick)
            print("\n".join(profile), flush=True)
            for line in profile:
                if not line.startswith(" "):
                    emit(result, {"kind": "profile", "text": line})
        except Exception as error:
            print(f"host profile: {type(error).__name__}: {error}", flush=True)
            emit(result, {"kind": "profile", "text": f"host profile: {type(error).__name__}: {error}"})
    elif table == "serving":
        from benchmarks import serving

        for line in serving.serving_rows(args.quick or SERVING_QUICK, args.repeats, backend="cuda"):
            print(line, flush=True)
            emit(result, {"kind": "line", "text": line})
    elif table in ("flash_attn", "flex"):
        from benchmarks import flash_attn, flex

        rows = flash_attn.flash_attn_rows if table == "flash_attn" else flex.flex_rows
        try:
            lines = rows(args.quick, args.repeats, "cuda")
        except Exception as error:  # a wrong result or a failed launch: reported
            print(f"{table}: {type(error).__name__}: {error}", flush=True)
            emit(result, {"kind": "error", "name": table, "error": f"{type(error).__name__}: {error}"})
            return
        for line in lines:
            print(line, flush=True)
            emit(result, {"kind": "line", "text": line})


def sanitized_workload() -> str:
    """A small bf16 forward and backward (the asynchronous-copy backward with atomics, and the
    deterministic one at D = 128: two warps a key group, the query-major dQ kernel; rows past the end
    copied as zeros), and a decoding step with its keys split (the in-kernel merge): what
    compute-sanitizer watches (its kernels compiled ahead by the compile phase's ``sanitize`` job, so
    that the tools' time goes to running them)."""
    import ml_dtypes
    import numpy as np

    import attncomp as ac
    from benchmarks import specs

    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((1, 2, 128, 64)).astype(ml_dtypes.bfloat16) for _ in range(3))
    fn = ac.compile(specs.causal_any, backend="cuda")
    out, pullback = fn.vjp(q, k, v)
    pullback(np.ones(np.shape(out), ml_dtypes.bfloat16))
    q, k, v = (rng.standard_normal((1, 2, 100, 128)).astype(ml_dtypes.bfloat16) for _ in range(3))
    out, pullback = ac.compile(specs.causal_any, backend="cuda", deterministic=True).vjp(q, k, v)
    pullback(np.ones(np.shape(out), ml_dtypes.bfloat16))
    qd = rng.standard_normal((1, 8, 512, 64)).astype(np.float32)
    kd, vd = (rng.standard_normal((1, 2, 512, 64)).astype(np.float32) for _ in range(2))
    dec = ac.compile(specs.gqa_decode, backend="cuda").decoder(max_len=512)
    dec(qd[:, :, :-1], kd[:, :, :-1], vd[:, :, :-1])
    dec(qd[:, :, -1:], kd[:, :, -1:], vd[:, :, -1:])
    return f"sanitized workload done: {dec.fn.program.attention[0].last_split} key splits in the step"


def worker_sanitize(args: argparse.Namespace) -> None:
    """:func:`sanitized_workload`, for compute-sanitizer to watch."""
    print(sanitized_workload())
    emit(Path(args.result), {"status": "passed"})


#: ``--worker KIND``: the function that runs in the subprocess (``Run.worker`` builds its command line)
WORKERS = {
    "environment": probe,
    "compile": worker_compile,
    "timings": worker_timings,
    "sanitize": worker_sanitize,
}
