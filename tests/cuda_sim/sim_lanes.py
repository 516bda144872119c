"""Numba's CUDA simulator with a block's threads run as generators in one Python thread.

``sim_coroutines.py`` rewrites a kernel so that each of its threads is a generator that yields at
``cuda.syncthreads`` (and the block votes) and at every warp instruction; here a block's threads
(its lanes) are resumed in turn by the launching thread, with no switch between operating-system
threads. The thread a lane runs in carries that lane's ``threadIdx``, ``blockIdx`` and
``thread_id`` while it runs (the simulator's ``cuda`` module and ``mma/warp_sim.py`` read them
there).

The order is fixed, and one the GPU may take: between two of the block's barriers one warp runs at
a time, as far as it can go (a warp instruction is computed once every lane of its warp has come to
it, and its lanes go on), the last warp first after an even number of barriers and the first warp
first after an odd number. A warp that reads shared memory another warp writes, with no barrier
between, reads it before the store in one of two barrier intervals in a row, whichever warp writes:
the memory's poison (``sim_memory.py``), so the missing barrier fails. A lane that cannot come to
its warp's instruction (it has returned, waits at the block's barrier, or is at another
instruction) is an error, as with the simulator's threads.

Kernels ``sim_coroutines`` cannot rewrite run on the simulator's threads (``sim_blocks.py``); so does
every kernel while ``RUNNER`` is ``"threads"``.
"""

from __future__ import annotations

import threading

import numpy as np

from tests.cuda_sim.sim_coroutines import VOTES, resumable_kernel

#: "lanes": kernels run as generators where they can be; "threads": on the simulator's threads
RUNNER = "lanes"

_READY, _BARRIER, _EXCHANGE, _DONE = range(4)
#: the attributes of the launching thread that the lanes running in it set (``abort`` and
#: ``syncthreads`` for a stop the rewrite did not see: raised at once, not waited for)
_ATTRIBUTES = ("threadIdx", "blockIdx", "thread_id", "_warp_sim_lane", "abort", "syncthreads")


class _Lane:
    __slots__ = ("index", "thread_idx", "generator", "state", "sent", "request", "cache")

    def __init__(self, index: int, thread_idx, generator):
        self.index, self.thread_idx, self.generator = index, thread_idx, generator
        self.state, self.sent, self.request, self.cache = _READY, None, None, None


class _Block:
    """One block's lanes, by thread id, and the thread they run in."""

    def __init__(self, manager, function, grid_point, args):
        from numba.cuda.simulator.kernel import Dim3

        self.thread = threading.current_thread()
        self.block_idx = Dim3(*grid_point)
        size = Dim3(*manager._block_dim)
        lanes = []
        for point in np.ndindex(*manager._block_dim):
            idx = Dim3(*point)
            index = idx.x + size.x * (idx.y + size.y * idx.z)
            lanes.append(_Lane(index, idx, None))
        self.lanes = sorted(lanes, key=lambda lane: lane.index)
        self.function, self.args = function, args
        self.warps = [self.lanes[i : i + 32] for i in range(0, len(self.lanes), 32)]

    def enter(self, lane: _Lane) -> None:
        thread = self.thread
        thread.threadIdx, thread.thread_id, thread._warp_sim_lane = lane.thread_idx, lane.index, lane.cache

    def failure(self, lane: _Lane, error: BaseException) -> BaseException:
        """``error`` as the launch raises it: named by the lane's thread and block, as the simulator does."""
        message = f"tid={list(lane.thread_idx)} ctaid={list(self.block_idx)}"
        if str(error):
            message += f": {error}"
        try:
            return type(error)(message).with_traceback(error.__traceback__)
        except Exception:  # an exception type that takes other arguments
            return error

    def step(self, lane: _Lane) -> None:
        """Run ``lane`` to its next stop, or to its end."""
        self.enter(lane)
        try:
            request = lane.generator.send(lane.sent)
        except StopIteration:
            lane.state = _DONE
            return
        except Exception as error:
            raise self.failure(lane, error) from None
        finally:
            lane.cache = self.thread.__dict__.get("_warp_sim_lane")
        lane.sent, lane.request = None, request
        lane.state = _EXCHANGE if request[0] == "exchange" else _BARRIER

    def run_warp(self, warp: list[_Lane], number: int) -> None:
        """Run one warp's lanes until each waits at the block's barrier or has ended."""
        while True:
            for lane in warp:
                if lane.state == _READY:
                    self.step(lane)
            waiting = [lane for lane in warp if lane.state == _EXCHANGE]
            if not waiting:
                return
            first = waiting[0]
            for lane in warp:
                if lane.state == _DONE:
                    problem = f"lane {lane.index % 32} of warp {number} has exited before a warp instruction"
                elif lane.state == _BARRIER:
                    problem = (
                        f"lane {lane.index % 32} of warp {number} waits at syncthreads while its warp waits at"
                        " a warp instruction"
                    )
                elif lane.request[2] is not first.request[2]:
                    problem = (
                        f"lane {lane.index % 32} of warp {number} is at {lane.request[2].__name__}, its warp at"
                        f" {first.request[2].__name__}"
                    )
                else:
                    continue
                raise self.failure(first, RuntimeError(problem))
            values: list = [None] * 32
            for lane in waiting:
                values[lane.index % 32] = lane.request[1]
            self.enter(waiting[-1])  # the instruction is computed by its last lane, as with threads
            try:
                result = first.request[2](values)
            except Exception as error:  # every lane would raise it
                raise self.failure(first, error) from None
            for lane in waiting:
                lane.sent, lane.state = (result, lane.index % 32), _READY

    def run(self) -> None:
        for lane in self.lanes:
            lane.generator = self.function(*self.args)
        barriers = 0
        while True:
            for number in range(len(self.warps))[:: 1 if barriers % 2 else -1]:
                self.run_warp(self.warps[number], number)
            waiting = [lane for lane in self.lanes if lane.state == _BARRIER]
            if not waiting:
                return
            vote = _vote(waiting)
            for lane in waiting:
                lane.sent, lane.state = vote, _READY
            barriers += 1

    def run_once(self) -> None:
        """A kernel that never stops: each lane runs to its end in turn."""
        for lane in self.lanes:
            self.enter(lane)
            try:
                self.function(*self.args)
            except Exception as error:
                raise self.failure(lane, error) from None

    def close(self) -> None:
        """End every lane that has not (a failed block's): a lane inside a device function gives back
        that function's ``cuda`` global before the next launch."""
        for lane in self.lanes:
            if lane.generator is not None and lane.state != _DONE:
                try:
                    lane.generator.close()
                except Exception:  # a lane that raises as it ends: the launch's error is reported
                    pass


def _vote(lanes: list[_Lane]):
    """What a barrier's yield gives its lanes: None, or the block's vote (``syncthreads_count`` and
    the others: over the threads at the barrier)."""
    kind = lanes[0].request[0]
    if kind not in VOTES:
        return None
    if any(lane.request[0] != kind for lane in lanes):
        raise RuntimeError(f"threads of a block at different barriers: {sorted({lane.request[0] for lane in lanes})}")
    votes = [bool(lane.request[1]) for lane in lanes]
    if kind == "syncthreads_count":
        return sum(votes)
    return int(all(votes)) if kind == "syncthreads_and" else int(any(votes))


def _unseen_stop() -> None:
    raise RuntimeError("a barrier reached through a call the rewrite could not follow (sim_coroutines.py)")


def _unwrapped(argument):
    """A kernel's array argument as its numpy array: the simulator wraps each in two objects whose
    indexing, in Python, is most of a simulated kernel's time; numpy indexes the same elements and
    raises the same out-of-bounds errors."""
    from numba.cuda.simulator.cudadrv.devicearray import FakeWithinKernelCUDAArray

    if type(argument) is FakeWithinKernelCUDAArray and type(argument._item._ary) is np.ndarray:
        return argument._item._ary
    return argument


def run_block(manager, function, grid_point, args) -> None:
    """Run one block of a launch with its threads as generators of ``function`` (or, where it never
    stops, ``function`` itself, one thread after the other)."""
    block = _Block(manager, function, grid_point, [_unwrapped(argument) for argument in args])
    thread = block.thread
    saved = {name: thread.__dict__[name] for name in _ATTRIBUTES if name in thread.__dict__}
    thread.blockIdx, thread.abort, thread.syncthreads = block.block_idx, True, _unseen_stop
    errors = np.errstate(divide="raise") if manager._debug else np.errstate()
    try:
        with errors:
            if function is manager._f:
                block.run_once()
            else:
                block.run()
    finally:
        block.close()
        for name in _ATTRIBUTES:
            thread.__dict__.pop(name, None)
        thread.__dict__.update(saved)


def ran_as_lanes(manager, grid_point, args) -> bool:
    """Run one block as generators, where ``RUNNER`` allows and the kernel can be rewritten; whether
    it did (``sim_blocks.py``'s ``BlockManager.run`` runs the rest on threads)."""
    function = None if RUNNER == "threads" else resumable_kernel(manager._f)
    if function is None:
        return False
    run_block(manager, function, grid_point, args)
    return True
