"""Context parallelism: one attention over a sequence sharded across ``torch.distributed`` ranks.

``balance`` deals the sequence's chunks out to ranks so that each computes the same live
tiles, ``Layout`` shards and unshards tensors for that deal, and ``context_parallel``
turns a compiled function into a differentiable callable that each rank calls with its
own shards (docs/distributed.md).  Importing this module never imports torch; calling
``context_parallel`` does (the ``torch`` extra).
"""

from attncomp.distributed.balance import balance
from attncomp.distributed.layout import Layout

__all__ = ["Layout", "balance", "context_parallel"]


def context_parallel(*args, **kwargs):  # noqa: ANN002, ANN003, ANN201
    from attncomp.distributed.context import context_parallel as make

    return make(*args, **kwargs)
