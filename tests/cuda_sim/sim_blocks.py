"""Numba's CUDA simulator with a block barrier that waits instead of polling, and threads kept
from one block to the next.

The simulator runs a block's threads as Python threads. Its ``BlockManager.run`` starts a new
thread for every thread of every block (some 15 ms for a block of 128), then loops over them
without pause from the main thread, asking each whether it waits at ``cuda.syncthreads``,
until all do or all have ended: the main thread holds the interpreter lock for much of every
switch interval, and a barrier is noticed only when the loop next comes round.

Here the barrier is a counter under a condition: the last thread of the block to arrive (or a
thread that ends while the rest wait) opens it at once, and the main thread sleeps until the
block has ended or a thread has raised. The threads are the simulator's own ``BlockThread``
kept in a pool: a thread that has run its part of a block waits for the next block's, with
that block's indices, rather than ending.

What the rest of the simulator and ``mma/warp_sim.py`` read is kept: each thread's indices,
``syncthreads_blocked`` while it waits, ``abort`` once another thread has raised,
``is_alive()`` false once its part of the block has ended, and the block's threads as the local
``threads`` of ``BlockManager.run``. The first exception a thread raises is raised from the
launch once the block's other threads have stopped at their next barrier or warp instruction:
the next launch never starts beside a thread of the last.
"""

from __future__ import annotations

import threading

import numpy as np

#: seconds a failed block's launch waits for each of its other threads to stop
_STRAGGLERS = 10.0


class BlockBarrier:
    """The barrier of one block: ``live`` threads not yet ended, ``waiting`` of them at it."""

    def __init__(self, threads: list):
        self.condition = threading.Condition()
        self.threads = threads
        self.live = len(threads)
        self.waiting: list = []
        self.failed = None  # the first thread that raised

    def _open(self) -> None:
        for thread in self.waiting:
            thread.syncthreads_blocked = False
            thread.syncthreads_event.set()
        self.waiting = []

    def arrive(self, thread) -> None:
        with self.condition:
            if thread.abort:
                raise RuntimeError("abort flag set on syncthreads call")
            thread.syncthreads_blocked = True
            self.waiting.append(thread)
            if len(self.waiting) == self.live:
                self._open()
        thread.syncthreads_event.wait()
        thread.syncthreads_event.clear()
        if thread.abort:
            raise RuntimeError("abort flag set on syncthreads clear")

    def leave(self, thread) -> None:
        """``thread`` has ended its part: the others no longer wait for it; if it raised, all stop."""
        with self.condition:
            self.live -= 1
            if thread.exception is not None and self.failed is None:
                self.failed = thread
                for other in self.threads:
                    other.abort = True
                    other.syncthreads_blocked = False
                    other.syncthreads_event.set()
            elif self.waiting and len(self.waiting) == self.live:
                self._open()
            thread.pool.give_back(thread)  # before the block can end: the next block finds it idle
            self.condition.notify_all()


class Pool:
    """Idle simulator threads, taken for a block and given back by each thread as its part ends."""

    def __init__(self, thread_class):
        self.thread_class = thread_class
        self.lock = threading.Lock()
        self.idle: list = []

    def take(self, count: int, manager) -> list:
        with self.lock:
            taken, self.idle = self.idle[:count], self.idle[count:]
        while len(taken) < count:
            thread = self.thread_class(None, manager, (0, 0, 0), (0, 0, 0), False)
            thread.pool, thread.job, thread.woken, thread.running = self, None, threading.Event(), False
            thread.start()
            taken.append(thread)
        return taken

    def give_back(self, thread) -> None:
        with self.lock:
            self.idle.append(thread)


def install(first=None) -> None:
    """Replace ``BlockManager.run`` and ``BlockThread``'s ``run``, ``syncthreads`` and ``is_alive``
    by the pooled threads and the waiting barrier; ``first(manager, grid_point, args)``, if given,
    is asked to run each block before (``sim_lanes.ran_as_lanes``), and the threads run the blocks
    it has not."""
    from numba.cuda.simulator import kernel

    Dim3 = kernel.Dim3

    def serve(self) -> None:
        """A pooled thread's life: each job is one thread's part of one block."""
        while True:
            self.woken.wait()
            self.woken.clear()
            target, barrier = self.job
            try:
                target()
            except Exception as error:
                message = f"tid={list(self.threadIdx)} ctaid={list(self.blockIdx)}"
                if str(error):
                    message += f": {error}"
                self.exception = (type(error)(message), error.__traceback__)
            finally:
                self.running, self.job = False, None
                barrier.leave(self)

    def assign_part(self, target, barrier, manager, grid_point, block_point, debug) -> None:
        """This thread's part of a block: its indices, and running (not ended) from now on, before
        any thread of the block starts: a warp instruction's waiting lane (``mma/warp_sim.py``) finds
        every lane of its block by its id and alive, started or not."""
        self._manager, self.debug = manager, debug
        self.blockIdx, self.threadIdx = Dim3(*grid_point), Dim3(*block_point)
        size = Dim3(*manager._block_dim)
        self.thread_id = self.threadIdx.x + size.x * (self.threadIdx.y + size.y * self.threadIdx.z)
        self.exception, self.abort, self.syncthreads_blocked = None, False, False
        self.syncthreads_event.clear()
        self.__dict__.pop("_warp_sim_lane", None)  # mma/warp_sim.py's cache: a warp of the last block
        self._barrier, self.running, self.job = barrier, True, (target, barrier)

    def syncthreads(self) -> None:
        self._barrier.arrive(self)

    def is_alive(self) -> bool:
        return self.running

    pool = Pool(kernel.BlockThread)

    def run(self, grid_point, *args) -> None:
        if first is not None and first(self, grid_point, args):
            return
        shape = list(np.ndindex(*self._block_dim))
        threads = pool.take(len(shape), self)  # the name mma/warp_sim.py looks for
        barrier = BlockBarrier(threads)

        def target():
            self._f(*args)

        if self._debug:

            def target():
                np.seterr(divide="raise")
                self._f(*args)

        for thread, block_point in zip(threads, shape):
            assign_part(thread, target, barrier, self, grid_point, block_point, self._debug)
        for thread in threads:
            thread.woken.set()
        with barrier.condition:
            while barrier.live and barrier.failed is None:
                barrier.condition.wait()
            # A failed block's other threads stop at their next barrier or warp instruction: wait for
            # them, so that none is still inside a device function (whose ``cuda`` global the
            # simulator swaps for this launch's) when the next launch starts.
            while barrier.live and barrier.condition.wait(timeout=_STRAGGLERS):
                pass
        if barrier.failed is not None:
            error, trace = barrier.failed.exception
            raise error.with_traceback(trace)

    kernel.BlockThread.run = serve
    kernel.BlockThread.syncthreads = syncthreads
    kernel.BlockThread.is_alive = is_alive
    kernel.BlockManager.run = run
