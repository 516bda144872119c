"""What the machine has: the packages against ``pyproject.toml``'s minimums, the GPU, and
``compute-sanitizer``; ``probe`` is the environment phase's worker."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from benchmarks.cuda_tools import find_cuda_tool
from benchmarks.gpu_check.plan import DISTRIBUTIONS, KNOWN_FAULTS, NEEDED, OPTIONAL, ROOT
from benchmarks.gpu_check.processes import emit


def minimum_versions(pyproject: Path = ROOT / "pyproject.toml") -> dict[str, str]:
    """``name>=version`` of every requirement in ``pyproject.toml`` (dependencies and extras)."""
    text = pyproject.read_text()
    found = re.findall(r'"([A-Za-z0-9_.\-]+)(?:\[[^\]]*\])?>=([0-9][0-9.]*)"', text)
    return {name.lower().replace("_", "-"): version for name, version in found}


def version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", version.split("+")[0])[:3])


def find_sanitizer() -> str | None:
    """``compute-sanitizer``: on PATH, under ``$CUDA_HOME`` or ``/usr/local/cuda*``, or in an nvidia wheel."""
    return find_cuda_tool("compute-sanitizer")


def gpu_reason(info: dict) -> str | None:
    """None when Numba-CUDA sees a GPU (and ``info`` gets its name, capability and driver), else why not."""
    try:
        from numba import cuda
    except ImportError as error:
        return f"numba-cuda is not installed ({error})"
    try:
        if not cuda.is_available():
            return "Numba-CUDA sees no GPU"
        device = cuda.get_current_device()
        name = device.name.decode() if isinstance(device.name, bytes) else str(device.name)
        info.setdefault("gpu_name", name)
        info["compute_capability"] = ".".join(map(str, device.compute_capability))
        version = cuda.cudadrv.driver.driver.get_version()
        info["cuda_driver"] = ".".join(map(str, version))
    except Exception as error:  # a broken driver counts as no GPU
        return f"no usable CUDA GPU ({type(error).__name__}: {error})"
    return None


def compile_reason() -> str | None:
    """None when Numba-CUDA compiles a trivial kernel to PTX, else the error, with the known fix where
    ``KNOWN_FAULTS`` has one: an installation that cannot compile fails every later phase alike."""

    def store_one(a):
        a[0] = 1.0

    try:
        from numba import cuda

        cuda.compile_ptx(store_one, "void(float32[:])")
    except Exception as error:  # any failure of the installation, reported rather than raised
        text = f"{type(error).__name__}: {error}"
        fixes = [fix for marker, fix in KNOWN_FAULTS.items() if marker in text]
        return f"Numba-CUDA cannot compile a kernel ({text})" + (f": {fixes[0]}" if fixes else "")
    return None


def probe(args: argparse.Namespace) -> None:
    """The environment phase's worker: everything above, printed and written as one record."""
    import importlib.metadata
    import importlib.util
    import platform

    info: dict = {"python": sys.version.split()[0], "platform": platform.platform(), "cpus": os.cpu_count()}
    versions = {}
    for name in DISTRIBUTIONS:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    info["versions"] = versions
    minimum = minimum_versions()
    info["missing"] = [n for n in (*NEEDED, *OPTIONAL) if versions.get(n) is None]
    wanted = {n: minimum.get(n.lower().replace("_", "-")) for n in versions}
    info["too_old"] = [
        f"{n} {v} < {wanted[n]}"
        for n, v in versions.items()
        if v and wanted[n] and version_tuple(v) < version_tuple(wanted[n])
    ]
    info["minimum"] = minimum
    for module in ("xdist", "pytest_timeout"):
        info[f"has_{module}"] = importlib.util.find_spec(module) is not None
    smi = shutil.which("nvidia-smi")
    if smi:
        query = "name,driver_version,compute_cap,memory.total"
        try:
            done = subprocess.run(
                [smi, f"--query-gpu={query}", "--format=csv,noheader"], capture_output=True, text=True, timeout=20
            )
            print(f"nvidia-smi: {done.stdout.strip() or done.stderr.strip()}")
            fields = [f.strip() for f in done.stdout.splitlines()[0].split(",")] if done.stdout.strip() else []
            if len(fields) >= 3:
                info.update(gpu_name=fields[0], driver=fields[1], compute_capability=fields[2])
            if len(fields) >= 4:
                info["memory"] = fields[3]
        except (subprocess.TimeoutExpired, OSError) as error:
            print(f"nvidia-smi: {error}")
    if args.dry_run:
        info["gpu_reason"] = None
    else:
        info["gpu_reason"] = gpu_reason(info)
        info["compile_reason"] = compile_reason() if info["gpu_reason"] is None else None
    if versions.get("torch"):
        try:
            import torch

            info["torch_cuda"] = f"{torch.version.cuda} (available: {torch.cuda.is_available()})"
        except Exception as error:  # a broken torch counts as none
            info["torch_cuda"] = f"import failed: {error}"
    info["sanitizer"] = find_sanitizer()
    for key, value in info.items():
        print(f"{key}: {value}")
    emit(Path(args.result), info)
