"""PyTorch (docs/api.md section 6): ``fn.to_torch()``, a differentiable ``torch.library`` custom op.

Two specs are compiled on the cpu backend, once each for the whole file (each costs a Numba
compile of its saving forward and of its backward): ALiBi with learnable slopes in float32,
and a causal attention returning (out, lse) in float64 for ``gradcheck``.  The interp backend
gives the reference gradients.
"""

# Dimension names in annotations (ac.f64["T", "D"]) are not forward references.
# ruff: noqa: F821, UP037

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the torch extra is not installed: pip install 'attncomp[torch]'")

import attncomp as ac  # noqa: E402
from attncomp.compilation import Compilation  # noqa: E402
from attncomp.testing import relative_error  # noqa: E402
from attncomp.torch.eager import skips_dispatcher  # noqa: E402
from attncomp.torch.op import op_name  # noqa: E402
from attncomp.torch.tensors import check_device, is_host_scalar  # noqa: E402
from examples.alibi import alibi_slopes, causal_alibi  # noqa: E402
from examples.lse import key_padding_with_lse  # noqa: E402
from tests.conftest import TORCH_COMPILE  # noqa: E402

WINDOW = 6  # shorter than T: the window and the causal mask both cut rows
SIZES = {"B": 1, "H": 2, "T": 70, "S": 70, "D": 8, "E": 8}  # two query and key blocks of 64


@ac.spec
def causal_lse_f64(
    q: ac.f64["B", "H", "T", "D"],
    k: ac.f64["B", "H", "S", "D"],
    v: ac.f64["B", "H", "S", "E"],
):
    scores = (q @ k.mT) * q.shape[-1] ** -0.5
    b, h, i, j = ac.index(scores)
    scores = ac.where(j <= i, scores, -ac.inf)
    return ac.softmax(scores, axis=-1) @ v, ac.logsumexp(scores, axis=-1)


@pytest.fixture(scope="session")
def alibi_fn() -> ac.CompiledFunction:
    """One compiled function a test process, as its torch op is registered once a process (the op of
    a second compile of the same spec runs the first's): a module's fixtures may be made again in a
    process that ran some of its tests before (the ``torch.compile`` tests' worker)."""
    return ac.compile(causal_alibi, backend="cpu", window=WINDOW)


@pytest.fixture(scope="module")
def alibi(alibi_fn):
    return alibi_fn.to_torch()


@pytest.fixture(scope="module")
def causal64_fn() -> ac.CompiledFunction:
    return ac.compile(causal_lse_f64, backend="cpu")


def alibi_inputs(seed: int = 0, T: int = SIZES["T"], requires_grad: bool = True) -> list[torch.Tensor]:
    rng = np.random.default_rng(seed)
    B, H, D, E = SIZES["B"], SIZES["H"], SIZES["D"], SIZES["E"]
    arrays = [rng.standard_normal(shape, dtype=np.float32) for shape in ((B, H, T, D), (B, H, T, D), (B, H, T, E))]
    return [torch.tensor(a, requires_grad=requires_grad) for a in [*arrays, alibi_slopes(H)]]


def causal64_inputs(seed: int = 0, T: int = 9, D: int = 4) -> list[torch.Tensor]:
    rng = np.random.default_rng(seed)
    return [torch.tensor(rng.standard_normal((1, 2, T, D)), requires_grad=True) for _ in range(3)]


def torch_alibi(q, k, v, slopes, window: int = WINDOW):
    """The same formula in PyTorch, differentiated by its autograd."""
    i = torch.arange(q.shape[-2])[:, None]
    j = torch.arange(k.shape[-2])[None, :]
    s = q @ k.mT * q.shape[-1] ** -0.5 + slopes[:, None, None] * (j - i)
    s = s.masked_fill(~((j <= i) & (i - j < window)), float("-inf"))
    return torch.softmax(s, -1) @ v


def torch_causal_lse(q, k, v):
    i, j = torch.arange(q.shape[-2])[:, None], torch.arange(k.shape[-2])[None, :]
    s = (q @ k.mT * q.shape[-1] ** -0.5).masked_fill(j > i, float("-inf"))
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


def grads_of(tensors) -> list[np.ndarray | None]:
    return [None if t.grad is None else t.grad.numpy().copy() for t in tensors]


def numpy_of(tensors) -> list[np.ndarray]:
    return [t.detach().numpy() for t in tensors]


# forward and gradients ------------------------------------------------------------------------
def test_forward_and_gradients_match_vjp_and_the_interpreter(alibi_fn, alibi):
    inputs = alibi_inputs()
    out = alibi(*inputs)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32 and out.shape == (1, 2, 70, 8)
    d_out = torch.tensor(np.random.default_rng(1).standard_normal(tuple(out.shape), dtype=np.float32))
    out.backward(d_out)
    got = grads_of(inputs)
    assert got[3] is not None and got[3].shape == (2,), "the learnable slopes get a gradient"

    expected_out, pullback = alibi_fn.vjp(*numpy_of(inputs))
    np.testing.assert_allclose(out.detach().numpy(), expected_out, rtol=1e-6, atol=1e-6)
    for g, want in zip(got, pullback(d_out.numpy())):
        np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-6)

    reference = ac.compile(causal_alibi, backend="interp", window=WINDOW)
    ref_out, ref_pullback = reference.vjp(*numpy_of(inputs))
    assert relative_error(out.detach().numpy(), ref_out) < 1e-5
    for k, (g, want) in enumerate(zip(got, ref_pullback(d_out.numpy()))):
        assert relative_error(g, want) < 1e-4, f"argument {k}"


def test_gradients_match_torch_autograd_of_the_formula(alibi):
    ours, theirs = alibi_inputs(seed=3), alibi_inputs(seed=3)
    alibi(*ours).square().sum().backward()
    torch_alibi(*theirs).square().sum().backward()
    for k, (g, want) in enumerate(zip(grads_of(ours), grads_of(theirs))):
        assert relative_error(g, want) < 1e-4, f"argument {k}"


def test_out_and_lse_both_in_the_loss(causal64_fn):
    attn = causal64_fn.to_torch()
    ours, theirs = causal64_inputs(T=70, D=8), causal64_inputs(T=70, D=8)
    rng = np.random.default_rng(5)
    w_out, w_lse = torch.tensor(rng.standard_normal((1, 2, 70, 8))), torch.tensor(rng.standard_normal((1, 2, 70)))

    out, lse = attn(*ours)
    assert out.dtype == lse.dtype == torch.float64 and lse.shape == (1, 2, 70)
    ((out * w_out).sum() + (lse * w_lse).sum()).backward()
    ref_out, ref_lse = torch_causal_lse(*theirs)
    ((ref_out * w_out).sum() + (ref_lse * w_lse).sum()).backward()
    assert relative_error(out.detach().numpy(), ref_out.detach().numpy()) < 1e-12
    assert relative_error(lse.detach().numpy(), ref_lse.detach().numpy()) < 1e-12
    _, pullback = causal64_fn.vjp(*numpy_of(ours))
    for k, (g, want, vjp) in enumerate(zip(grads_of(ours), grads_of(theirs), pullback(w_out.numpy(), w_lse.numpy()))):
        assert relative_error(g, want) < 1e-10, f"argument {k} against torch"
        np.testing.assert_array_equal(g, vjp, err_msg=f"argument {k} against fn.vjp")


def test_only_out_in_the_loss_gives_lse_a_zero_cotangent(causal64_fn):
    attn = causal64_fn.to_torch()
    ours, theirs = causal64_inputs(seed=2), causal64_inputs(seed=2)
    attn(*ours)[0].sum().backward()
    torch_causal_lse(*theirs)[0].sum().backward()
    for g, want in zip(grads_of(ours), grads_of(theirs)):
        assert relative_error(g, want) < 1e-12


def test_integer_inputs_get_no_gradient():
    """Key lengths (int32) are an ordinary input with no gradient; the interp backend is cheap to compile."""
    attn = ac.compile(key_padding_with_lse, backend="interp").to_torch()
    q, k, v = causal64_inputs(seed=4, D=8)[:3]
    q, k, v = (t.detach().float().requires_grad_() for t in (q, k, v))
    lengths = torch.tensor([5], dtype=torch.int32)
    out, lse = attn(q, k, v, lengths)
    assert torch.all(lse[..., :] > float("-inf"))
    (out.sum() + lse.sum()).backward()
    assert lengths.grad is None
    assert torch.all(k.grad[:, :, 5:] == 0) and torch.all(v.grad[:, :, 5:] == 0), "padded keys get no gradient"
    assert torch.any(k.grad[:, :, :5] != 0)


@ac.spec
def paged_keys(q: ac.f32["B", "H", "T", "D"], pages: ac.f32["N", "P", "H", "D"], table: ac.i32["B", "E"]):
    k = ac.page_view(pages, table, table.shape[1] * pages.shape[1], slot=1)
    return ac.softmax(q @ k.mT, axis=-1) @ k


def test_a_spec_without_a_gradient_is_a_forward_only_op():
    """A spec reading pages (``ac.page_view`` has no gradient rule) becomes an op that runs where no
    gradient is wanted and, where one is, raises naming the spec and the op, eagerly and traced."""
    attn = ac.compile(paged_keys, backend="interp").to_torch()
    g = torch.Generator().manual_seed(3)
    q, pages = torch.randn(1, 2, 3, 4, generator=g), torch.randn(4, 2, 2, 4, generator=g)
    table = torch.tensor([[2, 0]], dtype=torch.int32)
    keys = pages[table.long()].flatten(1, 2).transpose(1, 2)  # [1, H, 4, D]
    want = torch.softmax(q @ keys.mT, -1) @ keys
    torch.testing.assert_close(attn(q, pages, table), want)
    assert attn.backward_op is None
    with pytest.raises(RuntimeError, match=r"@paged_keys has no gradient \(autodiff: no gradient rule for ac.page_"):
        attn(q.requires_grad_(), pages, table)
    out = attn.op(q, pages, table)[0]  # the registered op (the result, then residuals): its backward raises
    with pytest.raises(RuntimeError, match="@paged_keys has no gradient"):
        out.sum().backward()


def test_an_argument_that_needs_no_gradient_gets_none_computed(alibi):
    """Slopes that need no gradient (frozen, or a mask added to the scores): the backward that runs
    neither computes nor returns theirs; the others' are the full backward's."""
    full, frozen = alibi_inputs(seed=6), alibi_inputs(seed=6)
    frozen[3].requires_grad_(False)
    alibi(*full).square().sum().backward()
    alibi(*frozen).square().sum().backward()
    assert frozen[3].grad is None and full[3].grad is not None
    for k in range(3):
        np.testing.assert_allclose(frozen[k].grad.numpy(), full[k].grad.numpy(), rtol=1e-6, atol=1e-7)
    plan = alibi.plan_of(frozen)
    backward, _ = plan.partial[("slopes",)]
    assert len(backward.func.results) == 3 and len(plan.backward.func.results) == 4
    assert "d_slopes" not in backward.ir("autodiff") and "d_slopes" in plan.backward.ir("autodiff")


def test_non_contiguous_inputs(alibi):
    q, k, v, slopes = alibi_inputs(requires_grad=False)
    q_t = q.transpose(-1, -2).contiguous().transpose(-1, -2)  # same values, other strides
    assert not q_t.is_contiguous()
    torch.testing.assert_close(alibi(q_t, k, v, slopes), alibi(q, k, v, slopes), rtol=0, atol=0)


def test_cpu_tensors_are_passed_as_views(alibi_fn, alibi, monkeypatch):
    """The compiled forward reads the tensors' own memory and its result is the tensor's: no copies.

    The backward then runs from the saved residuals, not by running the forward again.
    """
    calls = []
    saving = alibi_fn.forward_saving.compilation  # the compilation the op runs
    run = Compilation.run_contiguous  # every run of the op's numpy views on the cpu

    def recording_run(self, args):
        outputs = run(self, args)
        if self is saving:
            calls.append((args, outputs))
        return outputs

    monkeypatch.setattr(Compilation, "run_contiguous", recording_run)
    inputs = alibi_inputs(requires_grad=True)
    out = alibi(*inputs)
    assert len(calls) == 1, "one forward run"
    arrays, outputs = calls[0]
    for array, t in zip(arrays, inputs):
        assert np.shares_memory(array, t.detach().numpy())
    assert np.shares_memory(out.detach().numpy(), outputs[0])
    out.sum().backward()
    assert len(calls) == 1, "the backward reuses the saved residuals: the forward does not run again"
    assert inputs[3].grad is not None


def test_in_a_module_training_learns_the_slopes(alibi):
    class AlibiAttention(torch.nn.Module):
        def __init__(self, heads: int):
            super().__init__()
            self.slopes = torch.nn.Parameter(torch.zeros(heads))

        def forward(self, q, k, v):
            return alibi(q, k, v, self.slopes)

    q, k, v, _ = alibi_inputs(seed=7, requires_grad=False)
    target = torch_alibi(q, k, v, torch.tensor([0.8, 0.3]))
    module = AlibiAttention(heads=2)
    optimizer = torch.optim.Adam(module.parameters(), lr=0.05)
    losses = []
    for _ in range(8):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(module(q, k, v), target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert losses[-1] < 0.5 * losses[0], losses
    assert torch.all(module.slopes > 0.2)


# torch.library checks -------------------------------------------------------------------------
def test_opcheck(alibi):
    inputs = alibi_inputs(T=9)
    torch.library.opcheck(alibi.op, tuple(inputs))


def test_opcheck_of_the_backward_op(alibi_fn, alibi):
    inputs = alibi_inputs(T=9, requires_grad=False)
    saving = alibi_fn.forward_saving
    outputs = saving.compilation.run(numpy_of(inputs))
    saved = outputs[len(outputs) - saving.func.attrs["residuals"] :]
    d_out = torch.ones(1, 2, 9, 8)
    torch.library.opcheck(alibi.backward_op, (*inputs, *map(torch.from_numpy, saved), d_out))
    # the backward a traced call runs where the slopes need no gradient: three results, not four
    without = alibi.backward_op_without(("slopes",))
    torch.library.opcheck(without, (*inputs, *map(torch.from_numpy, saved), d_out))
    assert len(without(*inputs, *map(torch.from_numpy, saved), d_out)) == 3


@pytest.mark.parametrize("backend", ["cpu", "interp"])
def test_gradcheck_float64(backend, causal64_fn):
    fn = causal64_fn if backend == "cpu" else ac.compile(causal_lse_f64, backend="interp")
    assert torch.autograd.gradcheck(fn.to_torch(), tuple(causal64_inputs(T=9, D=4)), eps=1e-6, atol=1e-8, rtol=1e-5)


# torch.compile ----------------------------------------------------------------------------------
def compiled_loss(alibi, backend):
    def loss(q, k, v, slopes):
        return alibi(q, k, v, slopes).square().sum()

    return torch.compile(loss, fullgraph=True, backend=backend, dynamic=True)


def check_against_eager(alibi, compiled, T: int) -> None:
    eager_inputs, compiled_inputs = alibi_inputs(seed=T, T=T), alibi_inputs(seed=T, T=T)
    alibi(*eager_inputs).square().sum().backward()
    compiled(*compiled_inputs).backward()
    for k, (g, want) in enumerate(zip(grads_of(compiled_inputs), grads_of(eager_inputs))):
        np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-6, err_msg=f"argument {k}")


@TORCH_COMPILE
def test_torch_compile_aot_eager_dynamic_shapes(alibi):
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")
    compiled = compiled_loss(alibi, counter)
    for T in (70, 33):  # a second size reuses the graph: sizes are symbolic in the fake function
        check_against_eager(alibi, compiled, T)
    assert counter.frame_count == 1


def cxx_compiler_works() -> bool:
    """Whether a C++ compiler compiles a file: inductor's CPU code generation needs one."""
    compiler = next(filter(None, map(shutil.which, (os.environ.get("CXX", "g++"), "c++", "clang++"))), None)
    if compiler is None:
        return False
    program = "int main() { return 0; }"
    result = subprocess.run(
        [compiler, "-x", "c++", "-c", "-o", os.devnull, "-"], input=program, text=True, capture_output=True
    )
    return result.returncode == 0


@TORCH_COMPILE
def test_torch_compile_leaves_out_the_gradients_nobody_wants(alibi):
    """Traced, the backward of a call whose slopes need no gradient is the registered op without
    them (``backward_op_without``): no slopes' gradient computed, the others the eager call's."""
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def keep(graph, example_inputs):  # the traced graph, run as it is
        graphs.append(str(graph.graph))
        return graph.forward

    backend = aot_autograd(fw_compiler=keep, bw_compiler=keep)
    compiled = torch.compile(lambda *a: alibi(*a).square().sum(), fullgraph=True, backend=backend)
    eager_inputs, compiled_inputs = alibi_inputs(seed=8), alibi_inputs(seed=8)
    for inputs in (eager_inputs, compiled_inputs):
        inputs[3].requires_grad_(False)
    alibi(*eager_inputs).square().sum().backward()
    compiled(*compiled_inputs).backward()
    assert compiled_inputs[3].grad is None
    assert len(graphs) == 2 and "_backward_without_slopes" in graphs[1] and "_backward." not in graphs[1]
    for k in range(3):
        np.testing.assert_allclose(compiled_inputs[k].grad.numpy(), eager_inputs[k].grad.numpy(), rtol=1e-5, atol=1e-6)


@TORCH_COMPILE
@pytest.mark.skipif(not cxx_compiler_works(), reason="torch.compile's inductor backend needs a working C++ compiler")
def test_torch_compile_inductor(alibi):
    check_against_eager(alibi, compiled_loss(alibi, "inductor"), 70)


# errors -------------------------------------------------------------------------------------------
def error_of(call, *args) -> BaseException:
    try:
        call(*args)
    except Exception as error:  # the error itself is what is compared
        return error
    raise AssertionError("no error")


def test_wrong_dtype_is_the_numpy_type_error(alibi_fn, alibi):
    q, k, v, slopes = alibi_inputs(requires_grad=False)
    expected = error_of(alibi_fn, q.double().numpy(), k.numpy(), v.numpy(), slopes.numpy())
    got = error_of(alibi, q.double(), k, v, slopes)
    assert type(got) is type(expected) is TypeError
    assert str(got) == str(expected) == "q: expected f32 (float32) elements, got float64"
    with pytest.raises(TypeError, match=r"^k: expected f32 \(float32\) elements, got int32$"):
        alibi(q, k.to(torch.int32), v, slopes)
    # bf16 converts to f32 without loss: accepted for an f32 argument, as int32 is for i64
    torch.testing.assert_close(alibi(q, k.bfloat16(), v, slopes), alibi(q, k.bfloat16().float(), v, slopes))


def test_wrong_size_is_the_numpy_shape_error(alibi_fn, alibi):
    q, k, v, slopes = alibi_inputs(requires_grad=True)
    k_short = k.detach()[..., :4].requires_grad_()
    expected = error_of(alibi_fn, *numpy_of([q, k_short, v, slopes]))
    got = error_of(alibi, q, k_short, v, slopes)
    assert type(got) is type(expected) is ac.ShapeError
    assert str(got) == str(expected) == "k: dimension D is 4, but q gave D = 8"
    with pytest.raises(ac.ShapeError, match=r"slopes: dimension H is 3, but q gave H = 2"):
        alibi(q, k, v, torch.zeros(3))
    with pytest.raises(TypeError, match=r"takes 4 arguments \(q, k, v, slopes\), got 3"):
        alibi(q, k, v)


def test_device_checks():
    """Tensors must be where the program reads them (``Program.device_type``), whatever the backend."""
    host = ac.compile(causal_lse_f64, backend="interp").compilation.program
    device = ac.compile(causal_lse_f64, backend="cuda").compilation.program  # built, never run here
    check_device("q", torch.device("cpu"), host)
    check_device("q", torch.device("cuda", 0), device)
    check_device("q", torch.device("meta"), host, allow_meta=True)
    with pytest.raises(ValueError, match=r"^q: a cuda tensor, but this function runs on the 'interp' backend"):
        check_device("q", torch.device("cuda", 0), host)
    with pytest.raises(ValueError, match=r"^v: a cpu tensor, but this function runs on the 'cuda' backend"):
        check_device("v", torch.device("cpu"), device)
    with pytest.raises(ValueError, match=r"^k: a meta tensor"):
        check_device("k", torch.device("meta"), host)
    # a CPU scalar (0-d: a seed, a temperature) goes to a device call by value, as PyTorch's do
    check_device("seed", torch.device("cpu"), device, scalar=True)
    with pytest.raises(ValueError, match=r"^seed: a cuda tensor, but this function runs on the 'interp' backend"):
        check_device("seed", torch.device("cuda", 0), host, scalar=True)
    assert is_host_scalar(torch.tensor(3)) and not is_host_scalar(torch.tensor([3]))
    assert skips_dispatcher(torch, [torch.tensor(3)], "cuda") and not skips_dispatcher(torch, [torch.ones(2)], "cuda")


def test_meta_tensors_give_shapes_without_running(alibi):
    q, k, v, slopes = (t.detach().to("meta") for t in alibi_inputs(T=11))
    out = alibi(q, k, v, slopes)
    assert out.device.type == "meta" and out.shape == (1, 2, 11, 8) and out.dtype == torch.float32


# names and the optional dependency -----------------------------------------------------------------
def test_op_names_are_stable_and_unique(alibi_fn, alibi):
    assert alibi.name == op_name(alibi_fn)
    assert alibi.name.startswith("causal_alibi_") and str(alibi.op._qualname).startswith("attncomp::")
    assert alibi_fn.to_torch() is alibi
    same = ac.compile(causal_alibi, backend="interp", window=WINDOW)
    assert op_name(same) == op_name(ac.compile(causal_alibi, backend="interp", window=WINDOW))
    others = {
        op_name(same),
        op_name(ac.compile(causal_alibi, backend="interp", window=WINDOW + 1)),
        alibi.name,
    }
    assert len(others) == 3, "backends and constants give different ops"


def test_import_attncomp_does_not_import_torch():
    code = "import attncomp, sys; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
    # nor does the torch package itself, and inside it `import torch` is PyTorch, not the package
    code = (
        "import sys, attncomp.torch, attncomp.distributed; assert 'torch' not in sys.modules, 'torch was imported'; "
        "from attncomp.torch.op import require_torch; torch = require_torch(); "
        "assert torch is sys.modules['torch'] and hasattr(torch, 'library') and torch.__name__ == 'torch', torch"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_to_torch_without_torch_says_how_to_install(monkeypatch):
    fn = ac.compile(causal_alibi, backend="interp")
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch now raises ImportError
    with pytest.raises(ImportError, match=r'pip install "attncomp\[torch\]"'):
        fn.to_torch()
