"""PyTorch: a compiled function as a differentiable op, ``fn.to_torch()`` (docs/api.md section 6).

- ``op.py``: :func:`to_torch` and :class:`~attncomp.torch.op.TorchFunction`, the callable it
  returns: the registered ``torch.library`` custom ops (forward and backward, with their fake
  functions) and the call, which runs eager tensors past the dispatcher.
- ``plan.py``: what the calls share: where each output goes (``Slots``), and per key of argument
  dtypes the compilations (``Plan``), kept in the op's one cache.
- ``autograd.py``: the one autograd path, the registered op's and the eager calls' alike.
- ``eager.py``: when a call may skip the dispatcher, and autocast.
- ``tensors.py``: tensors as the arrays a program reads (numpy views of CPU tensors, device
  tensors in place on the current stream), results back as tensors, and the checks that name
  an argument.

torch is imported only when ``to_torch`` is called: ``import attncomp`` never loads it.  Inside this
package ``import torch`` is PyTorch itself (imports are absolute), never this package.
"""

from attncomp.torch.op import to_torch

__all__ = ["to_torch"]
