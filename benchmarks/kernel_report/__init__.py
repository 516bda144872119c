"""An instruction report of the tensor-core kernels, without a GPU.

    python -m benchmarks.kernel_report                      # the default kernels, sm_90
    python -m benchmarks.kernel_report --arch sm_80 sm_90
    python -m benchmarks.kernel_report --spec causal_any --dtype bf16 --head-dim 64 128 --backward
    python -m benchmarks.kernel_report --json report.json

Each kernel is compiled to PTX as a call with C-contiguous arrays launches it, assembled by
nvJitLink into a cubin and disassembled by ``nvdisasm``; printed per kernel are ptxas' registers and
spills, static shared memory, resident blocks per SM, SASS instructions per ``HMMA`` over the kernel
and in its main loop (the innermost loop holding the most ``HMMA``), and the loads and stores by
kind and width.  Needs the ``cuda`` extra (numba-cuda, NVVM, nvJitLink, nvdisasm).

``sass.py`` reads the disassembly, ``assemble.py`` makes it, ``occupancy.py`` holds the per-target
limits, ``kernels.py`` the kernels reported, ``report.py`` the figures and their printing.
"""
