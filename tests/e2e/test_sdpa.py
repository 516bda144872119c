"""``attncomp.sdpa.scaled_dot_product_attention``: PyTorch's SDPA arguments and results, computed by attncomp.

Against ``torch.nn.functional.scaled_dot_product_attention`` itself: causal and grouped-query, boolean
masks (full, key padding, three dimensions), a float mask with ``-inf`` (its gradient too), and
dropout against the same mask law.  Most run on the reference interpreter (no compile); one forward
and backward runs the cpu kernels.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the torch extra is not installed: pip install 'attncomp[torch]'")

from attncomp.ir.ops.random import uniform  # noqa: E402
from attncomp.sdpa import scaled_dot_product_attention as sdpa  # noqa: E402
from tests.conftest import TORCH_COMPILE  # noqa: E402

F = torch.nn.functional.scaled_dot_product_attention
B, H, KV, L, S = 2, 4, 2, 70, 75


def qkv(seed: int = 0, requires_grad: bool = False):
    g = torch.Generator().manual_seed(seed)
    shapes = ((B, H, L, 16), (B, KV, S, 16), (B, KV, S, 8))
    return [torch.randn(*shape, generator=g).requires_grad_(requires_grad) for shape in shapes]


def masks():
    g = torch.Generator().manual_seed(1)
    full = torch.rand(B, 1, L, S, generator=g) > 0.3
    padding = torch.ones(B, 1, 1, S, dtype=torch.bool)
    padding[1, ..., 60:] = False
    bias = torch.randn(1, H, L, S, generator=g)
    bias[..., 40:] = float("-inf")
    return {"bool": full, "key padding": padding, "float": bias, "2d": full[0, 0]}


@pytest.mark.parametrize("kind", ["causal", "bool", "key padding", "float", "2d"])
def test_the_interpreter_gives_torchs_results(kind):
    q, k, v = qkv()
    options = {"is_causal": True} if kind == "causal" else {"attn_mask": masks()[kind], "scale": 0.3}
    got = sdpa(q, k, v, enable_gqa=True, backend="interp", **options)
    torch.testing.assert_close(got, F(q, k, v, enable_gqa=True, **options), rtol=1e-5, atol=1e-6)


def test_three_dimensions_and_errors():
    q, k, v = (x[:, 0] for x in qkv())
    mask = masks()["bool"][:, 0]
    torch.testing.assert_close(sdpa(q, k, v, attn_mask=mask, backend="interp"), F(q, k, v, attn_mask=mask))
    q, k, v = qkv()
    with pytest.raises(ValueError, match="attn_mask and is_causal are exclusive"):
        sdpa(q, k, v, attn_mask=mask, is_causal=True, enable_gqa=True)
    with pytest.raises(ValueError, match="pass enable_gqa=True"):
        sdpa(q, k, v)
    with pytest.raises(ValueError, match=r"attn_mask of shape \[3, 75\] does not broadcast to \[2, 4, 70, 75\]"):
        sdpa(q, k, v, attn_mask=torch.ones(3, S, dtype=torch.bool), enable_gqa=True)


def test_cpu_forward_and_gradients_match_torch_a_learned_bias_included():
    q, k, v = qkv(requires_grad=True)
    bias = masks()["float"].requires_grad_()
    ours = [t.detach().clone().requires_grad_() for t in (q, k, v, bias)]
    out = sdpa(*ours[:3], attn_mask=ours[3], enable_gqa=True)
    want = F(q, k, v, attn_mask=bias, enable_gqa=True)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
    cotangent = torch.randn_like(want)
    out.backward(cotangent)
    want.backward(cotangent)
    for got, ref in zip(ours, (q, k, v, bias)):
        finite = torch.isfinite(ref.grad)
        torch.testing.assert_close(got.grad[finite], ref.grad[finite], rtol=1e-4, atol=1e-5)


def test_dropout_drops_what_ac_random_draws():
    """A new seed each call from torch's CPU generator, the probabilities kept where
    ``ac.random(seed, b, h, i, j) >= p`` and scaled by ``1 / (1 - p)``."""
    q, k, v = qkv()
    torch.manual_seed(5)
    got = sdpa(q, k, v, dropout_p=0.25, is_causal=True, enable_gqa=True, backend="interp")
    torch.manual_seed(5)
    seed = torch.randint(-(2**63), 2**63 - 1, (), dtype=torch.int64)
    keep = torch.from_numpy(uniform(np.int64(seed.item()), *np.ogrid[:B, :H, :L, :S]) >= 0.25)
    kr, vr = (x.repeat_interleave(H // KV, dim=1) for x in (k, v))
    scores = (q @ kr.mT / 4.0).masked_fill(torch.ones(L, S, dtype=torch.bool).triu(1), float("-inf"))
    want = (scores.softmax(-1) * keep / 0.75) @ vr
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert (sdpa(q, k, v, dropout_p=0.25, is_causal=True, enable_gqa=True, backend="interp") - got).abs().max() > 0.1


@TORCH_COMPILE
def test_under_torch_compile_fullgraph():
    """The spec compiles at trace time (a constant of the trace), the op is opaque to the graph: no
    graph break, the gradients PyTorch's."""
    q, k, v = qkv(requires_grad=True)
    mask = masks()["bool"]

    def loss(q, k, v):
        return sdpa(q, k, v, attn_mask=mask, enable_gqa=True, backend="interp").square().sum()

    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    compiled(q, k, v).backward()
    ours = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    F(q, k, v, attn_mask=mask, enable_gqa=True).square().sum().backward()
    for got, x in zip(ours, (q, k, v)):
        torch.testing.assert_close(got, x.grad, rtol=1e-4, atol=1e-5)


@TORCH_COMPILE
def test_under_torch_compile_with_dynamic_sizes():
    """Sizes dynamic in the trace (``dynamic=True``): the default scale is read from the sizes inside the
    spec and the default dropout rate stays a constant, so the spec still compiles at trace time; two
    lengths, one trace.  A module's numbers, which the trace makes symbols (its scale and dropout rate),
    are compiled in as the values they have (they failed the trace)."""
    g = torch.Generator().manual_seed(5)

    class Attend(torch.nn.Module):
        def __init__(self, scale=None):
            super().__init__()
            self.scale, self.rate = scale, 0.0

        def forward(self, q, k, v):
            rate, scale = self.rate, self.scale
            return sdpa(q, k, v, dropout_p=rate, is_causal=True, scale=scale, enable_gqa=True, backend="interp")

    for scale in (None, 0.3):
        compiled = torch.compile(Attend(scale), fullgraph=True, dynamic=True, backend="aot_eager")
        for length in (L, L - 9):
            q, k, v = (torch.randn(B, h, length, 16, generator=g) for h in (H, KV, KV))
            want = F(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
            torch.testing.assert_close(compiled(q, k, v), want, rtol=1e-5, atol=1e-6)
