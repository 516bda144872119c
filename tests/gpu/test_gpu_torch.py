"""``fn.to_torch()`` on CUDA tensors: forward and gradients against PyTorch autograd on the GPU,
on PyTorch's current stream, inside a training step.
"""

# Dimension names in annotations (ac.f32["T", "D"]) are not forward references.
# ruff: noqa: F821, UP037

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the torch extra is not installed")
if not torch.cuda.is_available():
    pytest.skip("PyTorch sees no CUDA GPU", allow_module_level=True)

import attncomp as ac  # noqa: E402
from examples.alibi import causal_alibi  # noqa: E402
from examples.causal import causal  # noqa: E402
from examples.gqa import grouped_query_attention  # noqa: E402

WINDOW = 100


def _normal(*shape, seed: int = 0, requires_grad: bool = True) -> torch.Tensor:
    generator = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(shape, device="cuda", dtype=torch.float32, generator=generator)
    return x.requires_grad_(requires_grad)


def _inputs(shapes, seed: int = 0) -> list[torch.Tensor]:
    return [_normal(*shape, seed=seed + n) for n, shape in enumerate(shapes)]


def _clone(tensors) -> list[torch.Tensor]:
    return [t.detach().clone().requires_grad_() for t in tensors]


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).abs().max() / want.abs().max())


def _check_against(ours, theirs, inputs, seed: int = 7) -> None:
    """Forward values and every input's gradient of ``ours`` against ``theirs`` (PyTorch autograd)."""
    mine, reference = _clone(inputs), _clone(inputs)
    out, want = ours(*mine), theirs(*reference)
    assert out.device.type == "cuda" and out.dtype == torch.float32 and out.shape == want.shape
    assert _relative(out, want) < 1e-4
    d_out = _normal(*out.shape, seed=seed, requires_grad=False)
    out.backward(d_out)
    want.backward(d_out)
    for k, (a, b) in enumerate(zip(mine, reference)):
        assert a.grad is not None and a.grad.device.type == "cuda", f"argument {k}"
        assert _relative(a.grad, b.grad) < 1e-4, f"argument {k}: {_relative(a.grad, b.grad):.2e}"


@pytest.fixture(scope="module", autouse=True)
def _no_tf32():
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


def test_causal_against_sdpa():
    attn = ac.compile(causal, backend="cuda").to_torch()

    def sdpa(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    _check_against(attn, sdpa, _inputs([(2, 4, 333, 64)] * 3))


def test_grouped_query_heads_against_sdpa():
    attn = ac.compile(grouped_query_attention, backend="cuda").to_torch()

    def sdpa(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    _check_against(attn, sdpa, _inputs([(1, 8, 200, 64), (1, 2, 250, 64), (1, 2, 250, 64)]))


def test_alibi_with_learnable_slopes_against_the_formula():
    attn = ac.compile(causal_alibi, backend="cuda", window=WINDOW).to_torch()

    def formula(q, k, v, slopes):
        i = torch.arange(q.shape[-2], device="cuda")[:, None]
        j = torch.arange(k.shape[-2], device="cuda")[None, :]
        s = q @ k.mT * q.shape[-1] ** -0.5 + slopes[:, None, None] * (j - i)
        s = s.masked_fill(~((j <= i) & (i - j < WINDOW)), float("-inf"))
        return torch.softmax(s, -1) @ v

    q, k, v = _inputs([(2, 4, 300, 64)] * 3, seed=3)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], device="cuda", requires_grad=True)
    _check_against(attn, formula, [q, k, v, slopes])


def test_a_side_stream_orders_with_the_ops_around_it():
    """The op runs on PyTorch's current stream: produced, used and differentiated on a side stream."""
    attn = ac.compile(causal, backend="cuda").to_torch()
    q, k, v = _inputs([(1, 4, 500, 64)] * 3, seed=9)
    want = attn(q, k, v)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        q2, k2, v2 = (x.detach() * 1.0 for x in (q, k, v))  # produced on the side stream
        got = attn(q2, k2, v2) * 1.0
    torch.cuda.current_stream().wait_stream(stream)
    assert torch.equal(got, want.detach())


def test_results_and_workspace_come_from_torchs_allocator():
    """The op's device memory is PyTorch's (``tensors.DeviceMemory``): its result lies in one of the
    caching allocator's segments, a bf16 result too, and the memory the calls took is given back to
    it, not to the driver (what torch reserves does not grow over repeated calls)."""
    attn = ac.compile(causal, backend="cuda").to_torch()
    q, k, v = _inputs([(1, 4, 300, 64)] * 3, seed=11)

    def in_torchs_memory(t: torch.Tensor) -> bool:
        segments = torch.cuda.memory_snapshot()
        address = t.data_ptr()
        return any(s["address"] <= address < s["address"] + s["total_size"] for s in segments)

    with torch.no_grad():
        out = attn(q, k, v)
        assert in_torchs_memory(out)
        half = attn(*(x.bfloat16() for x in (q, k, v)))
        assert half.dtype == torch.bfloat16 and in_torchs_memory(half)
        torch.cuda.synchronize()
        reserved = torch.cuda.memory_reserved()
        for _ in range(20):
            attn(q, k, v)
        torch.cuda.synchronize()
        assert torch.cuda.memory_reserved() == reserved


def test_training_follows_the_same_path_as_sdpa():
    """Twenty SGD steps of a projection feeding the op: the same losses as with SDPA, and lower."""

    def train(attention) -> list[float]:
        torch.manual_seed(0)
        proj = torch.nn.Linear(64, 3 * 64, device="cuda")
        teacher = torch.nn.Linear(64, 3 * 64, device="cuda")
        optimizer = torch.optim.SGD(proj.parameters(), lr=1.0)
        x = _normal(2, 96, 64, seed=4, requires_grad=False)

        def heads(layer):
            q, k, v = layer(x).reshape(2, 96, 3, 4, 16).permute(2, 0, 3, 1, 4)
            return q.contiguous(), k.contiguous(), v.contiguous()

        with torch.no_grad():
            target = torch.nn.functional.scaled_dot_product_attention(*heads(teacher), is_causal=True)
        losses = []
        for _ in range(20):
            optimizer.zero_grad()
            loss = (attention(*heads(proj)) - target).square().mean()
            loss.backward()
            optimizer.step()
            losses.append(float(loss.detach()))
        return losses

    ours = train(ac.compile(causal, backend="cuda").to_torch())
    theirs = train(lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
    assert ours[-1] < 0.8 * ours[0]
    for step, (a, b) in enumerate(zip(ours, theirs)):
        assert abs(a - b) <= 1e-4 * abs(b), f"step {step}: {a} against {b}"


def test_bf16_tensors_passed_to_a_call():
    """torch CUDA bf16 tensors go to ``fn(...)`` and to a decoder's steps as their 16-bit patterns (the
    array interface has no bf16): the result is the torch op's; a tensor that requires grad is refused
    naming it."""
    from tests.passes.specs import generic_alibi

    fn = ac.compile(generic_alibi, backend="cuda")
    q, k, v = (_normal(1, 2, 130, 64, seed=n, requires_grad=False).bfloat16() for n in range(3))
    slopes = torch.tensor([0.5, 0.25], device="cuda", dtype=torch.bfloat16)
    got = fn(q, k, v, slopes).copy_to_host()
    want = fn.to_torch()(q, k, v, slopes)
    assert want.dtype == torch.bfloat16
    assert _relative(torch.from_numpy(got.astype("float32")), want.float().cpu()) < 1e-2
    with pytest.raises(TypeError, match=r"^k: a tensor that requires grad"):
        fn(q, k.clone().requires_grad_(), v, slopes)
    prefill = fn.decoder(256, dtype="bf16")(q, k, v, slopes).copy_to_host()  # a decoder's step takes them too
    assert _relative(torch.from_numpy(prefill.astype("float32")), want.float().cpu()) < 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sigmoid_attention_against_eager_pytorch(dtype):
    """``attncomp.sigmoid_attention`` on CUDA tensors (the score function's exp, log and division on
    the special function unit): outputs and gradients against PyTorch's eager sigmoid attention."""
    import math

    from attncomp.sigmoid_attention import sigmoid_attention

    q, k, v = (x.detach().to(dtype).requires_grad_() for x in _inputs([(2, 4, 300, 64)] * 3))
    got = sigmoid_attention(q, k, v, is_causal=True)
    causal = torch.ones(300, 300, dtype=torch.bool, device="cuda").tril()
    qf, kf, vf = _clone([x.float() for x in (q, k, v)])
    want = torch.where(causal, torch.sigmoid(qf @ kf.transpose(-1, -2) / 8.0 - math.log(300)), 0.0) @ vf
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    assert _relative(got.float(), want) < tolerance
    d_out = _normal(2, 4, 300, 64, seed=9, requires_grad=False)
    grads = torch.autograd.grad(got, (q, k, v), d_out.to(dtype))
    expected = torch.autograd.grad(want, (qf, kf, vf), d_out)
    for g, e in zip(grads, expected):
        assert _relative(g.float(), e) < 10 * tolerance
