"""Context parallelism over NCCL with the cuda backend (docs/distributed.md), on one GPU.

NCCL needs a GPU per rank, so one GPU runs a group of one: the ring makes no step, but every
other piece runs on the device as it would on many, through the same code as on the CPU's gloo
tests (tests/context_parallel): the agreement's all-gather over NCCL, the chunk-pair parts compiled
for cuda and called on CUDA tensors with their offsets, the log-sum-exp merges, the backward's
parts and the captured tensors' all-reduce.
"""

# Dimension names in annotations (ac.floating["T", "D"]) are not forward references.
# ruff: noqa: F821, UP037

from __future__ import annotations

import socket

import pytest

torch = pytest.importorskip("torch", reason="the torch extra is not installed")
if not torch.cuda.is_available():
    pytest.skip("PyTorch sees no CUDA GPU", allow_module_level=True)
if not torch.distributed.is_available() or not torch.distributed.is_nccl_available():
    pytest.skip("torch.distributed has no NCCL", allow_module_level=True)

import attncomp as ac  # noqa: E402
import attncomp.distributed as acd  # noqa: E402


@ac.spec
def causal_alibi(
    q: ac.floating["B", "H", "T", "D"],
    k: ac.floating["B", "H", "S", "D"],
    v: ac.floating["B", "H", "S", "E"],
    slopes: ac.floating["H"],
):
    s = (q @ k.mT) * q.shape[-1] ** -0.5
    b, h, i, j = ac.index(s)
    s = s + slopes[h] * (j - i)
    return ac.softmax(ac.where(j <= i, s, -ac.inf), axis=-1) @ v


@pytest.fixture(scope="module")
def nccl_group():
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_context_parallel_over_nccl_matches_the_torch_op(nccl_group, dtype):
    fn = ac.compile(causal_alibi, backend="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, d_out = (torch.randn(1, 2, 512, 64, device="cuda", dtype=dtype, generator=g) for _ in range(4))
    slopes = torch.tensor([0.25, 0.0625], device="cuda", dtype=dtype)
    layout = acd.balance(fn, 1, q, k, v, slopes, chunks_per_rank=4)
    attention = acd.context_parallel(fn, layout, timeout=60)
    inputs = [x.clone().requires_grad_() for x in (q, k, v, slopes)]
    out = attention(*[layout.shard(x, 0) if x.dim() == 4 else x for x in inputs])
    out.backward(layout.shard(d_out, 0))
    assert attention.last["pairs"] == 4 * 5 // 2  # the 4 chunks' causal pairs, none of the 6 masked ones
    reference = [x.clone().requires_grad_() for x in (q, k, v, slopes)]
    want = fn.to_torch()(*reference)
    want.backward(d_out)
    tolerance = 3e-2 if dtype == torch.bfloat16 else 1e-4
    scale = want.float().abs().max()
    assert (layout.unshard([out]).float() - want.float()).abs().max() <= tolerance * scale
    for got, ref in zip(inputs, reference):
        whole = layout.unshard([got.grad]) if got.dim() == 4 else got.grad
        assert (whole.float() - ref.grad.float()).abs().max() <= tolerance * max(1.0, ref.grad.float().abs().max())
