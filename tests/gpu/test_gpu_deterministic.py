"""``deterministic=True`` on a GPU: runs of ``fn.to_torch()``'s backward on CUDA tensors give the same
bits, and the gradients of the default (atomic) kernels up to rounding.

Sizes span many key and query blocks, so that the default kernels' atomics (dQ from every key block,
dK/dV from each group of query heads, the slopes' and the table's sums) would add in varying orders.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the torch extra is not installed")
if not torch.cuda.is_available():
    pytest.skip("PyTorch sees no CUDA GPU", allow_module_level=True)

import attncomp as ac  # noqa: E402
from examples.alibi import alibi_slopes, causal_alibi  # noqa: E402
from examples.causal import causal  # noqa: E402
from examples.gqa import grouped_query_attention  # noqa: E402
from examples.relative_bias import relative_bias  # noqa: E402
from tests.cuda_sim.helpers import retyped  # noqa: E402

RUNS = 3
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 6e-2}
BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16}


def _tensor(shape, seed: int, dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(shape, device="cuda", dtype=torch.float32, generator=generator).to(dtype)


CASES = {
    "causal": (causal, [(2, 8, 517, 64)] * 3),
    "gqa": (grouped_query_attention, [(2, 8, 400, 64), (2, 2, 450, 64), (2, 2, 450, 64)]),
    "alibi": (causal_alibi, [(2, 8, 517, 64)] * 3 + [None]),
    "relative_bias": (relative_bias, [(1, 8, 300, 64)] * 3 + [(8, 33)]),
}


def _gradients(fn, inputs: list[torch.Tensor], d_out: torch.Tensor) -> list[torch.Tensor]:
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    fn(*leaves).backward(d_out)
    return [x.grad for x in leaves]


@pytest.mark.timeout(300)  # two backward groups compiled cold: over 120 s with 16 processes compiling (H100)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_backward_runs_give_the_same_bits(name, dtype):
    spec, shapes = CASES[name]
    spec = spec if dtype == torch.float32 else retyped(spec, "bf16")
    inputs = [
        _tensor(s, seed=n, dtype=dtype) if s else torch.tensor(alibi_slopes(8), device="cuda", dtype=dtype)
        for n, s in enumerate(shapes)
    ]
    compiled = ac.compile(spec, backend="cuda", deterministic=True)
    deterministic = compiled.to_torch()
    default = ac.compile(spec, backend="cuda").to_torch()
    d_out = _tensor(deterministic(*inputs).shape, seed=99, dtype=dtype)
    runs = [_gradients(deterministic, inputs, d_out) for _ in range(RUNS)]
    want = _gradients(default, inputs, d_out)
    # bf16 on tensor cores (``mma/deterministic.py``) but for the table indexed per element
    (kernels,) = compiled.backward.compilation.program.backward
    assert kernels.choice_for(64, 64).mma == (dtype == torch.bfloat16 and name != "relative_bias")
    for k, first in enumerate(runs[0]):
        for again in runs[1:]:
            assert torch.equal(first.view(BITS[dtype]), again[k].view(BITS[dtype])), f"argument {k}"
        error = float((first.double() - want[k].double()).abs().max() / want[k].double().abs().max())
        assert error < TOLERANCE[dtype], f"argument {k}: {error:.2e}"
