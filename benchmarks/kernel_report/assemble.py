"""PTX to cubin (nvJitLink) to SASS (``nvdisasm``), without a GPU.

The PTX comes from ``attncomp.backends.numba_cuda.ptx.compile_ptx_for`` and ptxas' resource report
(registers, spills) from its ``ptxas_report``; here the same PTX is linked once more for the cubin,
which ``nvdisasm`` (the ``nvidia-cuda-nvdisasm`` wheel, in the ``cuda`` extra) turns into SASS.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import tempfile
from pathlib import Path

from benchmarks.cuda_tools import find_cuda_tool

_SHARED = re.compile(r"(\d+) bytes smem")


def find_nvdisasm() -> str | None:
    """``nvdisasm``: in an nvidia wheel first (the version nvJitLink comes with), else a toolkit's."""
    return find_cuda_tool("nvdisasm", wheels_first=True)


def toolchain_missing() -> str | None:
    """Why a report cannot be made here (None: numba-cuda with NVVM, nvJitLink and nvdisasm are all
    installed)."""
    if importlib.util.find_spec("numba_cuda") is None:
        return "numba-cuda is not installed: pip install -e '.[cuda]'"
    if os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0"):
        return "the CUDA simulator is on (NUMBA_ENABLE_CUDASIM): its kernels have no PTX"
    from attncomp.backends.numba_cuda.ptx import nvjitlink_available

    if not nvjitlink_available():
        return "nvJitLink is not installed (cuda-toolkit[nvjitlink], in the cuda extra)"
    if find_nvdisasm() is None:
        return "nvdisasm is not found (cuda-toolkit[nvdisasm] / nvidia-cuda-nvdisasm, in the cuda extra)"
    return None


def link_cubin(ptx: str, cc: tuple[int, int]) -> bytes:
    """One kernel's PTX assembled for ``sm_XY`` by nvJitLink: the cubin."""
    from cuda.bindings import nvjitlink

    handle = nvjitlink.create(1, [f"-arch=sm_{cc[0]}{cc[1]}"])
    try:
        data = ptx.encode()
        nvjitlink.add_data(handle, nvjitlink.InputType.PTX, data, len(data), "kernel.ptx")
        nvjitlink.complete(handle)
        cubin = bytearray(nvjitlink.get_linked_cubin_size(handle))
        nvjitlink.get_linked_cubin(handle, cubin)
    finally:
        nvjitlink.destroy(handle)
    return bytes(cubin)


def disassemble(cubin: bytes, nvdisasm: str | None = None) -> str:
    """The SASS of a cubin's code sections (``nvdisasm -c``)."""
    nvdisasm = nvdisasm or find_nvdisasm()
    if nvdisasm is None:
        raise RuntimeError("nvdisasm is not found (pip install nvidia-cuda-nvdisasm)")
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "kernel.cubin"
        path.write_bytes(cubin)
        done = subprocess.run([nvdisasm, "-c", str(path)], capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"nvdisasm failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def shared_bytes(log: str) -> int:
    """Static shared memory of a kernel, from nvJitLink's verbose log (``... 19460 bytes smem``)."""
    found = [int(x) for x in _SHARED.findall(log)]
    return max(found, default=0)
