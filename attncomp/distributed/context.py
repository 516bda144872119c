"""``context_parallel(fn, layout, group)``: a compiled function over a sequence sharded across ranks.

Each rank calls the result with its own shards (its chunks of q, k, v and of any
per-position captured tensor, as ``layout.shard`` cuts them) and the whole of every other
captured tensor; it returns that rank's shard of the output (and LSE, and each row's max
score, when the spec returns them), differentiable through torch autograd (the max score
passes no gradient).  A call:

1. agrees with the other ranks on the spec, the layout and every shape (each rank's errors
   reach every rank: :meth:`attncomp.distributed.collectives.Comm.agree`);
2. gathers the per-position captured tensors whole and classifies the chunk pairs on them
   (:meth:`attncomp.distributed.spec.SpecParts.pair_classes`), so skipped pairs never run;
3. runs the ring (:mod:`attncomp.distributed.ring`).

The backward runs the ring again with the saved output and LSE; gradients of captured
tensors are summed over the ranks (each rank then holds the whole sequence's gradient of
a shared tensor such as ALiBi slopes, and its own shard's of a per-position one).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from attncomp.distributed.balance import as_numpy, float_type, whole_arguments
from attncomp.distributed.collectives import Comm
from attncomp.distributed.layout import Layout, ring_steps
from attncomp.distributed.ring import Step, backward, forward
from attncomp.distributed.spec import SpecParts

#: what the gradient of a captured tensor every rank holds whole is: the sum over the ranks
#: (every rank holds the whole sequence's), or this rank's queries' part of it (a data-parallel
#: reduction of the model's parameters, such as DDP's, then sums it with the others)
SHARED_GRADS = ("sum", "local")

#: pair classes kept per call signature and captured values (a training loop repeats them)
CLASS_CACHE = 64


class ContextParallel:
    """``fn`` over this rank's shards of the sequence; see :func:`context_parallel`."""

    def __init__(self, fn: Any, layout: Layout, group: Any = None, timeout: float = 300.0, shared_grads: str = "sum"):
        import torch

        if not isinstance(layout, Layout):
            raise TypeError(f"layout: expected an attncomp.distributed.Layout, got {type(layout).__name__}")
        if shared_grads not in SHARED_GRADS:
            raise ValueError(f"shared_grads: expected one of {', '.join(SHARED_GRADS)}, got {shared_grads!r}")
        if not timeout > 0:
            raise ValueError(f"timeout: expected a positive number of seconds, got {timeout!r}")
        SpecParts.of(fn, None)  # the refusals, now: the same on every rank, before any collective
        self.torch = torch
        self.fn = fn
        self.layout = layout
        self.shared_grads = shared_grads
        self.comm = Comm(group, timeout)
        if layout.world != self.comm.world:
            raise ValueError(f"layout: made for {layout.world} ranks, but the group has {self.comm.world}")
        self._classes: dict[tuple, tuple[np.ndarray, int]] = {}
        #: what the last call did: its ring steps and the chunk pairs this rank computed
        self.last: dict[str, int] = {}

    @property
    def rank(self) -> int:
        return self.comm.rank

    def shard(self, x: Any, dim: int = -2) -> Any:
        """This rank's shard of the whole-sequence tensor ``x``."""
        return self.layout.shard(x, self.rank, dim)

    def unshard(self, x: Any, dim: int = -2) -> Any:
        """The whole sequence from every rank's shard ``x`` (a collective: every rank calls it)."""
        moved = x.movedim(dim, -1)
        gathered = self.comm.all_gather(moved.contiguous(), "the shards to unshard")
        return self.layout.unshard(gathered, -1).movedim(-1, dim)

    def __call__(self, *args: Any) -> Any:
        torch = self.torch
        parts, problem = self._check(args)
        self.comm.agree(self._record(parts, args), problem)
        assert parts is not None
        step = self._step(parts, args)
        wants_grad = torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
        if wants_grad:
            return _autograd(torch).apply(self, step, *args)
        return _picked(self.torch, parts, self._results(step, args))

    # the call's pieces ------------------------------------------------------------------
    def _check(self, args: tuple[Any, ...]) -> tuple[SpecParts | None, str | None]:
        """The spec's parts for these arguments, or the error this rank found in them."""
        torch = self.torch
        try:
            if not args:
                raise TypeError("expected the spec's arguments, got none")
            for n, a in enumerate(args):
                if not isinstance(a, torch.Tensor):
                    raise TypeError(f"argument {n}: expected a torch tensor, got {type(a).__name__}")
            parts = SpecParts.of(self.fn, float_type(args[0]))
            if len(args) != len(parts.arguments):
                raise TypeError(f"@{parts.member.name} takes {len(parts.arguments)} arguments, got {len(args)}")
            want = self.layout.shard_length
            for arg, x in zip(parts.arguments, args):
                if arg.seq_axis is not None and x.shape[arg.seq_axis] != want:
                    raise ValueError(
                        f"{arg.name}: this rank's shard has {x.shape[arg.seq_axis]} positions along dimension "
                        f"{arg.seq_axis}, the layout gives it {want} ({self.layout.chunks_per_rank} chunks of "
                        f"{self.layout.chunk})"
                    )
            parts.sizes(whole_arguments(parts, args, self.layout.length))  # shapes and types, checked
            return parts, None
        except Exception as error:  # every rank raises it (Comm.agree), so no rank waits forever
            return None, f"{type(error).__name__}: {error}"

    def _record(self, parts: SpecParts | None, args: tuple[Any, ...]) -> dict[str, Any]:
        layout = self.layout
        return {
            "spec": parts.digest if parts is not None else "",
            "layout": [layout.world, layout.length, layout.chunk, list(layout.owner)],
            "shapes": [list(getattr(a, "shape", ())) for a in args],
            "dtypes": [str(getattr(a, "dtype", type(a).__name__)) for a in args],
        }

    def _step(self, parts: SpecParts, args: tuple[Any, ...]) -> Step:
        layout = self.layout
        captured: dict[str, Any] = {}
        for arg, x in zip(parts.arguments, args):
            if arg.name in (parts.q, parts.k, parts.v):
                continue
            if arg.seq_axis is not None:
                moved = x.detach().movedim(arg.seq_axis, -1).contiguous()
                gathered = self.comm.all_gather(moved, f"the shards of {arg.name}")
                x = layout.unshard(gathered, -1).movedim(-1, arg.seq_axis).contiguous()
            captured[arg.name] = x.detach()
        whole = whole_arguments(parts, args, layout.length)
        whole.update({name: as_numpy(x) for name, x in captured.items()})
        key = (
            parts.digest,
            tuple(tuple(a.shape) for a in args),
            tuple(whole[n].tobytes() for n in parts.per_position),
            tuple(
                as_numpy(x).tobytes() for n, x in captured.items() if n not in parts.per_position and x.numel() < 4096
            ),
        )
        found = self._classes.get(key)
        if found is None:
            classes = parts.pair_classes(whole, layout.chunk)
            found = classes, ring_steps(layout, classes != 0)
            if len(self._classes) >= CLASS_CACHE:
                self._classes.clear()
            self._classes[key] = found
        return Step(parts, layout, found[0], found[1], parts.sizes(whole), captured)

    def _results(self, step: Step, args: tuple[Any, ...]) -> dict[str, Any]:
        """This rank's output and LSE (and each row's max score), by role, in the chunk pair part's
        result types (:func:`_picked` gives them in the spec's)."""
        results, computed = forward(self.torch, self.comm, step, *_qkv(step.parts, args))
        self.last = {"steps": step.steps, "pairs": computed}
        types = _torch_types(self.torch, step.parts.masked.forward.func.results)
        return {role: x.to(t) for role, x, t in zip(("out", "lse", "max"), results, types)}


def _torch_types(torch: Any, values: list[Any]) -> list[Any]:
    """The torch dtypes of IR values' element types."""
    from attncomp.ir.types import NUMPY_DTYPES

    return [getattr(torch, np.dtype(NUMPY_DTYPES[v.type.dtype]).name) for v in values]


def _picked(torch: Any, parts: SpecParts, results: dict[str, Any]) -> Any:
    """The spec's results: the attention's ones it returns, in its result types."""
    types = _torch_types(torch, parts.member.func.results)
    picked = [results[role].to(t) for role, t in zip(parts.returns, types)]
    return picked[0] if len(picked) == 1 else tuple(picked)


_AUTOGRAD: list[Any] = []


def _autograd(torch: Any) -> Any:
    """The ``torch.autograd.Function`` of a context-parallel call (made on first use: torch is optional)."""
    if _AUTOGRAD:
        return _AUTOGRAD[0]

    class ContextParallelAttention(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, cp: ContextParallel, step: Step, *args: Any) -> Any:
            parts = step.parts
            results = cp._results(step, args)
            ctx.cp, ctx.step = cp, step
            ctx.save_for_backward(*_qkv(parts, args), results["out"], results["lse"])
            ctx.arg_dtypes = [a.dtype for a in args]
            picked = _picked(torch, parts, results)
            for role, result in zip(parts.returns, picked if isinstance(picked, tuple) else (picked,)):
                if role == "max":  # each row's max score passes no gradient
                    ctx.mark_non_differentiable(result)
            return picked

        @staticmethod
        def backward(ctx: Any, *grads: Any) -> Any:
            cp, step = ctx.cp, ctx.step
            parts, layout = step.parts, step.layout
            q, k, v, out, lse = ctx.saved_tensors
            named = dict(zip(parts.returns, grads))
            d_out = named.get("out")
            d_out = torch.zeros_like(out) if d_out is None else d_out.to(out.dtype).contiguous()
            d_lse = named.get("lse")
            d_lse = torch.zeros_like(lse) if d_lse is None else d_lse.to(lse.dtype).contiguous()
            d_q, d_k, d_v, d_captured = backward(torch, cp.comm, step, (q, k, v, out, lse), d_out, d_lse)
            summed = [n for n in d_captured if cp.shared_grads == "sum" or parts.argument(n).seq_axis is not None]
            if summed:  # one sum over the ranks for the captured tensors' gradients
                flat = torch.cat([d_captured[n].reshape(-1) for n in summed])
                flat = cp.comm.all_reduce(flat, "the captured tensors' gradients")
                offset = 0
                for name in summed:
                    g = d_captured[name]
                    d_captured[name] = flat[offset : offset + g.numel()].reshape(g.shape)
                    offset += g.numel()
            by_name = {parts.q: d_q, parts.k: d_k, parts.v: d_v}
            for name, g in d_captured.items():
                axis = parts.argument(name).seq_axis
                by_name[name] = g if axis is None else layout.shard(g, cp.rank, axis)
            out_grads = []
            for arg, dtype in zip(parts.arguments, ctx.arg_dtypes):
                g = by_name.get(arg.name) if arg.floating else None
                out_grads.append(None if g is None else g.to(dtype))
            return (None, None, *out_grads)

    _AUTOGRAD.append(ContextParallelAttention)
    return ContextParallelAttention


def _qkv(parts: SpecParts, args: tuple[Any, ...]) -> list[Any]:
    named = dict(zip((a.name for a in parts.arguments), args))
    return [named[n].detach().contiguous() for n in (parts.q, parts.k, parts.v)]


def context_parallel(
    fn: Any, layout: Layout, group: Any = None, *, timeout: float = 300.0, shared_grads: str = "sum"
) -> ContextParallel:
    """``fn`` (a compiled function) over a sequence sharded across the ranks of ``group``.

    Every rank of ``group`` (default: the whole world) makes it with the same ``layout``
    (:func:`attncomp.distributed.balance`) and calls it with its own shards; ``timeout``
    bounds every wait on another rank, in seconds.  ``shared_grads``: the gradient of a
    captured tensor every rank holds whole (ALiBi slopes) is summed over the ranks ("sum"),
    or left as this rank's part ("local") for a data-parallel reduction that sums it with
    the model's other parameters.
    """
    return ContextParallel(fn, layout, group, timeout, shared_grads)
