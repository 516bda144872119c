"""The collectives a context-parallel call makes, each waited on with a timeout.

Every exchange is asynchronous (``batch_isend_irecv``, ``all_gather``, ``all_reduce`` with
``async_op=True``) and waited on with ``Work.wait(timeout)``, so a rank whose peer never
comes raises :class:`CollectiveTimeout` naming what it waited for, instead of hanging.
Before any exchange, :meth:`Comm.agree` all-gathers each rank's record of the call (the
spec, the shapes, the layout) and any error it found in its own arguments: every rank
then raises the same error, so a bad shard on one rank stops all of them.
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

#: the bytes of one rank's record in :meth:`Comm.agree`
RECORD_BYTES = 2048


class CollectiveTimeout(RuntimeError):
    """A peer did not answer within the call's timeout."""


class Comm:
    """One process group, as a context-parallel call uses it."""

    def __init__(self, group: Any, timeout: float):
        import torch
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("context_parallel needs torch.distributed initialised (dist.init_process_group)")
        self.torch = torch
        self.dist = dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.timeout = timedelta(seconds=timeout)
        backend = str(dist.get_backend(group))
        #: where tensors must be to travel: NCCL moves CUDA tensors only
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        #: bytes this rank has sent through the ring (read by the benchmark)
        self.sent_bytes = 0

    def peer(self, rank: int) -> int:
        """The global rank of the group's ``rank`` (what point-to-point ops name)."""
        if self.group is None:
            return rank
        return self.dist.get_global_rank(self.group, rank)

    def wait(self, works: list[Any], what: str) -> None:
        for work in works:
            try:
                work.wait(self.timeout)
            except RuntimeError as error:
                raise CollectiveTimeout(
                    f"context parallel, rank {self.rank}: {what} did not complete within "
                    f"{self.timeout.total_seconds():g} s ({error})"
                ) from error

    def exchange(self, tensors: list[Any], to: int, source: int) -> tuple[list[Any], list[Any]]:
        """Send ``tensors`` to rank ``to`` and receive as many of the same shapes from ``source``;
        returns the receive buffers and the pending works (pass them to :meth:`wait`)."""
        dist = self.dist
        received = [self.torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t.contiguous(), self.peer(to), self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, r, self.peer(source), self.group) for r in received]
        self.sent_bytes += sum(t.numel() * t.element_size() for t in tensors)
        return received, dist.batch_isend_irecv(ops)

    def all_gather(self, tensor: Any, what: str) -> list[Any]:
        moved = tensor.to(self.device).contiguous()
        gathered = [self.torch.empty_like(moved) for _ in range(self.world)]
        work = self.dist.all_gather(gathered, moved, group=self.group, async_op=True)
        self.wait([work], what)
        return [g.to(tensor.device) for g in gathered]

    def all_reduce(self, tensor: Any, what: str) -> Any:
        """The sum of ``tensor`` over the ranks."""
        moved = tensor.to(self.device).contiguous()
        work = self.dist.all_reduce(moved, group=self.group, async_op=True)
        self.wait([work], what)
        return moved.to(tensor.device)

    def agree(self, record: dict[str, Any], error: str | None) -> None:
        """Raise on every rank if any rank found an ``error`` or the ranks' ``record``s differ."""
        torch = self.torch
        text = json.dumps({"record": record, "error": error}, sort_keys=True).encode()
        if len(text) > RECORD_BYTES:  # an error too long to send: its start is enough to read
            text = json.dumps({"record": record, "error": (error or "")[:400]}, sort_keys=True).encode()
        buffer = torch.zeros(RECORD_BYTES, dtype=torch.uint8)
        buffer[: len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
        rows = self.all_gather(buffer, "the ranks' agreement on the call")
        seen = [json.loads(bytes(row.tolist()).rstrip(b"\0")) for row in rows]
        for rank, entry in enumerate(seen):
            if entry["error"]:
                raise ValueError(f"context parallel, rank {rank}: {entry['error']}")
        for rank, entry in enumerate(seen):
            if entry["record"] != seen[0]["record"]:
                differ = sorted(k for k in entry["record"] if entry["record"][k] != seen[0]["record"].get(k))
                raise ValueError(
                    f"context parallel: ranks 0 and {rank} disagree on {', '.join(differ)}: "
                    + "; ".join(f"{k}: {seen[0]['record'].get(k)} against {entry['record'][k]}" for k in differ)
                )
