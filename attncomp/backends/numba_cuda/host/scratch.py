"""Scratch device memory an attention kernel reuses from launch to launch: flash-decoding's partial
states and its count of finished splits.

A decoding step would otherwise pay a device allocation and free for each scratch array.  Launches
on one stream run in order, so a buffer is never written while an earlier launch still reads it;
each stream has its own, as launches on two streams may run at once.  The buffers of the
``STREAMS`` streams used most recently are kept; an older stream's are let go, so that many
short-lived streams do not hold device memory for as long as the function lives.  The view of
each shape is kept too (up to ``VIEWS`` a buffer): a Numba device array's slice and reshape are
some 13 us of Python (measured with its context check left out), and a split launch takes four.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from attncomp.backends.numba_cuda.host import arrays, launches

#: the streams whose scratch buffers are kept
STREAMS = 8
#: the views of one buffer kept by shape (a decoding loop's launches repeat one or two)
VIEWS = 16


class Scratch:
    """Buffers by (slot, dtype, stream), each with its views by shape."""

    def __init__(self) -> None:
        self.buffers: dict[tuple[int, Any, int], tuple[Any, dict[tuple[int, ...], Any]]] = {}
        self.streams: list[int] = []  # the streams that have buffers, the most recently used last

    def view(self, slot: int, shape: tuple[int, ...], dtype: Any, zeroed: bool = False) -> Any:
        """A device array of ``shape`` over buffer ``slot`` of the current stream, grown when too
        small (``zeroed``: zeroed when it is made; the kernels leave it zero after each launch)."""
        size = int(np.prod(shape, dtype=np.int64))
        stream = launches.stream_key()
        if not self.streams or self.streams[-1] != stream:
            if stream in self.streams:
                self.streams.remove(stream)
            self.streams.append(stream)
            for old in self.streams[:-STREAMS]:
                self.buffers = {k: b for k, b in self.buffers.items() if k[2] != old}
            del self.streams[:-STREAMS]
        key = (slot, dtype, stream)
        held = self.buffers.get(key)
        if held is None or held[0].size < size:
            buffer = arrays.zeros((max(size, 1),), dtype) if zeroed else arrays.scratch((max(size, 1),), dtype)
            held = self.buffers[key] = (buffer, {})
        buffer, views = held
        view = views.get(shape)
        if view is None:
            if len(views) >= VIEWS:
                views.clear()
            view = views[shape] = buffer[:size].reshape(shape)
        return view

    def held(self, stream: int) -> dict[int, Any]:
        """The buffers of ``stream`` (a ``launches.stream_key``), by slot."""
        return {slot: buffer for (slot, _, at), (buffer, _) in self.buffers.items() if at == stream}

    def held_streams(self) -> set[int]:
        """The streams that have buffers."""
        return {at for _, _, at in self.buffers}
