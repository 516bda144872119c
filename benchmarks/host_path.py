"""The cuda backend's host path without a GPU: a decoder step's Python with Numba's real device arrays.

    python -m benchmarks.host_path [--cache 4096] [--steps 300] [--profile]
    python -m benchmarks.host_path --serving [--steps 300] [--profile]

Numba's device arrays are made over memory that is never touched (made-up addresses), Numba's
context check (which asks the driver) is left out, allocations give such arrays, copies in and
out are counted and dropped (a copy out gives zeros), and so are launches: nothing runs on a
device, and what is timed is the host's work of a step (the decoder's checks, the generated
driver, argument views, scratch buffers, the cache views up to the length) as a GPU machine runs
it, less numba-cuda's own launch and the driver's calls.  The step is the ``benchmarks.gpu``
decoder row's (GQA 32/8, D = 128, float32), its cache holding twice the positions it attends;
with ``--serving``, a paged decoder's step of the GPU serving row (8 sequences sharing a 1,024
token prompt, 16 tokens of their own, a token each; H = 8, D = 64; host arrays in and out).  The
process's Numba is changed for good: run it as its own process.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import math
import pstats
import sys
import time
from typing import Any

import numpy as np

#: where the next made-up device allocation starts
_NEXT = [1 << 32]


def made_up_array(shape: Any, dtype: Any = np.float32, stream: Any = 0, **_: Any) -> Any:
    """A C-contiguous Numba device array over made-up memory (what ``cuda.device_array`` gives here;
    the tests of device views make theirs so too)."""
    from numba.cuda.cudadrv import devicearray, driver

    shape = tuple(int(n) for n in shape) if isinstance(shape, tuple | list) else (int(shape),)
    dtype = np.dtype(dtype)
    nbytes = max(math.prod(shape), 1) * dtype.itemsize
    memory = driver.MemoryPointer(None, driver.binding.CUdeviceptr(_NEXT[0]), nbytes)
    _NEXT[0] += -(-nbytes // 256) * 256
    strides = tuple(math.prod(shape[k + 1 :]) * dtype.itemsize for k in range(len(shape)))
    return devicearray.DeviceNDArray(shape, strides, dtype, gpu_data=memory, stream=stream)


#: copies in (host to device) and out that ``without_a_device`` dropped
COPIES = {"in": 0, "out": 0}


def without_a_device() -> list[int]:
    """Change this process's Numba and attncomp's launches as the module docstring says; the list
    it gives counts the launches dropped (``COPIES`` the copies)."""
    from numba import cuda
    from numba.cuda.cudadrv import devicearray, devices

    from attncomp.backends.numba_cuda.host import arrays, launches

    def to_device(x: Any, stream: Any = 0, **_: Any) -> Any:
        COPIES["in"] += 1
        return made_up_array(np.shape(x), np.asarray(x).dtype)

    def copy_to_device(self: Any, x: Any, stream: Any = 0) -> None:
        COPIES["in"] += 1

    def copy_to_host(self: Any, out: Any = None, stream: Any = 0) -> np.ndarray:
        COPIES["out"] += 1
        return np.zeros(self.shape, self.dtype) if out is None else out

    devices._runtime.ensure_context = contextlib.nullcontext
    cuda.device_array = made_up_array
    cuda.to_device = to_device
    devicearray.DeviceNDArray.copy_to_device = copy_to_device
    devicearray.DeviceNDArray.copy_to_host = copy_to_host
    arrays.fill_zero = lambda array: None  # a cache's zeros: a memset on a GPU, nothing here
    launches._MULTIPROCESSORS[:] = [132]  # an H100 SXM's, for the key splits
    dropped = [0]

    def launch(kernel: Any, grid: Any, block: Any, *args: Any) -> None:
        dropped[0] += 1

    launches.launch = launch
    return dropped


def decoder_step(cache: int) -> Any:
    """The decoder row's step (a cache of ``2 cache`` positions holding ``cache - 1``, one more
    appended and all attended), on made-up device arrays."""
    import attncomp as ac
    from benchmarks import specs

    q, k, v = made_up_array((1, 32, 1, 128)), made_up_array((1, 8, 1, 128)), made_up_array((1, 8, 1, 128))
    dec = ac.compile(specs.gqa_decode, backend="cuda").decoder(max_len=2 * cache)

    def step() -> Any:
        dec.length = cache - 1
        return dec(q, k, v)

    return step


def serving_step(steps: int) -> Any:
    """The GPU serving row's shared-prompt step (``benchmarks.serving``, quick sizes) on a device pool
    over made-up memory: 8 sequences forked from a 1,024-token prompt, 16 tokens of their own each,
    then a token each a step (the same tokens again: each step grows every sequence by one)."""
    from benchmarks import serving

    served = serving.shared_prompt("cuda", users=8, prompt=1024, own=16, steps=steps)
    return lambda: served.srv.step(served.token)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", type=int, default=4096, help="positions the step attends (default 4096)")
    parser.add_argument("--serving", action="store_true", help="a paged decoder's step (the GPU serving row's)")
    parser.add_argument("--steps", type=int, default=300, help="steps timed")
    parser.add_argument("--profile", action="store_true", help="then the functions by own time under cProfile")
    args = parser.parse_args(argv)
    from attncomp.backends.numba_cuda.host.launches import SIMULATED

    if SIMULATED:
        print("benchmarks.host_path: unset NUMBA_ENABLE_CUDASIM (the simulator's arrays are not Numba's)")
        return 2
    dropped = without_a_device()
    step = serving_step(1 + args.steps * (2 if args.profile else 1)) if args.serving else decoder_step(args.cache)
    step()
    before, copies = dropped[0], dict(COPIES)
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    seconds = (time.perf_counter() - start) / args.steps
    launches = (dropped[0] - before) / args.steps
    moved = {way: (COPIES[way] - copies[way]) / args.steps for way in COPIES}
    counts = f"{launches:g} launches, {moved['in']:g} copies in and {moved['out']:g} out a step"
    if args.serving:
        what = "paged decode step, 8 sequences sharing a 1024-token prompt (+16 own), H=8 D=64 float32"
    else:
        what = f"decoder step, GQA 32/8 D=128 float32, {args.cache} cached of {2 * args.cache}"
    print(f"{what}: host {seconds * 1e6:.1f} us a step without numba-cuda's launches and the driver ({counts})")
    if args.profile:
        profile = cProfile.Profile()
        profile.runcall(lambda: [step() for _ in range(args.steps)])
        pstats.Stats(profile).sort_stats("tottime").print_stats(20)
    return 0


if __name__ == "__main__":
    sys.exit(main())
