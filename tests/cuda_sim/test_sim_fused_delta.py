"""The backward's ``delta = rowsum(d_out * out) - d_lse``: one graph kernel (a reduction with its
elementwise producers and epilogue inline, ``host/fused_reductions.py``), reading ``d_out`` and
``out`` as stored and summing in float32; the gradients it feeds still match the float64
interpreter's, for f16, bf16 and float32 specs, a site's gradient (ALiBi's slopes) and an LSE
cotangent among them."""

import pytest

import attncomp as ac
from attncomp.backends.numba_cuda import runtime
from tests.cuda_sim.helpers import retyped
from tests.cuda_sim.test_sim_tensor_core_backward import PIPELINE, SIZES, backward_args, check
from tests.cuda_sim.test_sim_tensor_cores import attention_cases

CASES = ["causal.causal", "alibi.causal_alibi", "lse.key_padding_with_lse"]


def _typed(name: str, dtype: str):
    spec = dict(attention_cases())[name]
    return spec if dtype == "f32" else retyped(spec, dtype)


def _launches(monkeypatch) -> list[str]:
    """The names of the graph kernels the generated drivers launch from now on."""
    launched: list[str] = []
    launch_map = runtime.launch_map

    def counting(kernel, count, *args):
        launched.append(getattr(kernel, "__name__", None) or kernel.py_func.__name__)
        return launch_map(kernel, count, *args)

    monkeypatch.setattr(runtime, "launch_map", counting)
    return launched


@pytest.mark.parametrize("name", ["causal.causal", "lse.key_padding_with_lse"])
def test_the_delta_is_one_kernel(name, monkeypatch):
    """Before the attention backward the driver launches one kernel, the fused reduction: no casts,
    no product, no buffer between them (four kernels before; five with an LSE cotangent)."""
    typed = _typed(name, "bf16")
    fn = ac.compile(typed, backend="cuda", pipeline=PIPELINE)
    program = fn.backward.compilation.program
    assert [k.name for k in program.graph_kernels if not k.name.endswith("_reshape")] == ["k0_reduce"]
    (delta,) = program.graph_kernels[:1]
    if name.startswith("lse"):
        assert "reduced - " in delta.source  # d_lse is subtracted in the same kernel
    args = backward_args(typed, fn, SIZES, seed=3)
    launched = _launches(monkeypatch)
    fn.backward(*args)
    assert launched == ["k0_reduce"]  # the saved LSE's reshape is a view of a contiguous array


@pytest.mark.parametrize("dtype", ["f16", "bf16", "f32"])
@pytest.mark.parametrize("name", CASES)
def test_gradients_with_the_fused_delta(name, dtype):
    typed = _typed(name, dtype)
    fn = ac.compile(typed, backend="cuda", pipeline=PIPELINE)
    args = backward_args(typed, fn, SIZES, seed=5)
    got = fn.backward(*args)
    want = ac.compile(typed, backend="interp", pipeline=PIPELINE).backward.compilation.run(args, exact=True)
    assert [k.name for k in fn.backward.compilation.program.graph_kernels][:1] == ["k0_reduce"]
    check(list(got), want, dtype)
