"""PTX of the generated kernels, and what ptxas makes of it, without a GPU.

``numba.cuda.compile_ptx`` needs only NVVM (the ``cuda`` extra installs it
from wheels).  ``.local`` in the PTX means a kernel keeps an array in local
memory (an indexed local array the compiler could not put in registers).
Register spills happen later, in ptxas: when nvJitLink is installed
(``cuda-toolkit[nvjitlink]``), :func:`ptxas_report` links the PTX for the
target and reads ptxas' own report of registers, stack and spill bytes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

DEFAULT_CC = (8, 0)

_LOCAL = re.compile(r"\.local\b")
_REGISTERS = re.compile(r"Used (\d+) registers")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def compile_ptx(py_func: Any, signature: str, cc: tuple[int, int] = DEFAULT_CC, launch_bounds: Any = None) -> str:
    return compile_ptx_for(py_func, signature, [cc], launch_bounds)[cc]


def compile_ptx_for(
    py_func: Any, signature: str, ccs: list[tuple[int, int]], launch_bounds: Any = None
) -> dict[tuple[int, int], str]:
    """PTX of one kernel for several targets (with the ``launch_bounds`` its ``cuda.jit`` has, so
    that the PTX is the launched kernel's: ``.maxntid``, and ptxas' register limit, follow them).

    Numba's front end (typing, lowering to NVVM IR) does not depend on the
    target and takes most of the time, so it runs once and NVVM once per
    target, through numba-cuda's internal ``_compile_pyfunc_with_fixup``; a
    numba-cuda without it gets one ``compile_ptx`` per target.
    """
    from numba import cuda

    from attncomp.backends import compile_window
    from attncomp.backends.numba_cuda import lowering_fix

    lowering_fix.install()
    with compile_window.window("cuda"):  # backends/compile_window.py
        try:
            from numba.cuda.compiler import _compile_pyfunc_with_fixup
        except ImportError:
            return {cc: cuda.compile_ptx(py_func, signature, cc=cc, launch_bounds=launch_bounds)[0] for cc in ccs}
        library, _ = _compile_pyfunc_with_fixup(
            py_func,
            signature,
            debug=False,
            lineinfo=False,
            device=False,
            fastmath=False,
            cc=ccs[0],
            opt=True,
            abi="numba",
            abi_info=None,
            forceinline=False,
            launch_bounds=launch_bounds,
            lto=False,
        )
        found = {}
        for cc in ccs:
            (found[cc],) = library.get_asm_strs(cc=cc)  # one module: one PTX
        return found


def local_memory_lines(ptx: str) -> list[str]:
    """The PTX lines that declare or access local memory (empty for a kernel without any)."""
    return [line.strip() for line in ptx.splitlines() if _LOCAL.search(line)]


@dataclass(frozen=True)
class PtxasReport:
    registers: int
    stack_bytes: int
    spill_store_bytes: int
    spill_load_bytes: int
    log: str

    @property
    def spills(self) -> bool:
        return bool(self.spill_store_bytes or self.spill_load_bytes)


def nvjitlink_available() -> bool:
    try:
        from cuda.bindings import nvjitlink

        nvjitlink.version()
    except Exception:  # not installed, or its library is missing
        return False
    return True


def ptxas_report(ptx: str, cc: tuple[int, int] = DEFAULT_CC) -> PtxasReport:
    """Assemble one kernel's PTX for ``sm_XY`` with nvJitLink; ptxas' resource report."""
    from cuda.bindings import nvjitlink

    handle = nvjitlink.create(2, [f"-arch=sm_{cc[0]}{cc[1]}", "-verbose"])
    try:
        data = ptx.encode()
        nvjitlink.add_data(handle, nvjitlink.InputType.PTX, data, len(data), "kernel.ptx")
        nvjitlink.complete(handle)
        size = nvjitlink.get_info_log_size(handle)
        buffer = bytearray(size)
        nvjitlink.get_info_log(handle, buffer)
    finally:
        nvjitlink.destroy(handle)
    log = buffer.decode(errors="replace").rstrip("\0")
    registers = _REGISTERS.search(log)
    frame = _FRAME.search(log)
    if registers is None or frame is None:
        raise RuntimeError(f"unexpected ptxas report:\n{log}")
    stack, stores, loads = (int(x) for x in frame.groups())
    return PtxasReport(int(registers.group(1)), stack, stores, loads, log)
