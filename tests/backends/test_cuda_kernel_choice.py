"""Which CUDA kernel runs an attention (``numba_cuda.choice.KernelChoice``): what a user expects for
the common cases, printed as the first line of each kernel's source and listed by ``fn.kernels()``.

Source text only: no GPU, no simulator, nothing compiled.
"""

import importlib.util

import pytest

import attncomp as ac
from tests.conftest import load_example

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("numba_cuda") is None, reason="the cuda extra (numba-cuda) is not installed"
)

IEEE = "cse,softmax-fusion,flash-tiling{precision=ieee},mask-elimination,canonicalize,cse,dce"


def _spec(dtype: str = "f32"):
    from tests.cuda_sim.helpers import retyped

    spec = load_example("causal").causal
    return spec if dtype == "f32" else retyped(spec, dtype)


def _build(spec, pipeline: str | None = None, backward: bool = False, **constants):
    from attncomp.backends import numba_cuda

    fn = ac.compile(spec, backend="interp", pipeline=pipeline, **constants)
    return numba_cuda.build((fn.backward if backward else fn).module)


def test_bf16_runs_on_bf16_tensor_cores_from_its_16_bit_patterns():
    from attncomp.backends.numba_cuda.mma.atoms import M16N8K16

    (kernels,) = _build(_spec("bf16")).attention
    choice = kernels.choice_for(64, 64)
    assert (choice.family, choice.atom, choice.operands, choice.storage) == ("forward", M16N8K16, "bf16", "bits")
    assert choice.describe() == "forward, mma m16n8k16 bf16, async copies, storage bf16 bits, accumulate f32, atomic"
    staged = kernels.choice_for(64, 64, dense=False)  # strided rows: staged by loads and stores
    assert staged.describe() == "forward, mma m16n8k16 bf16, storage bf16 bits, accumulate f32, atomic"
    assert kernels.source(64, 64).splitlines()[0] == f"# kernel: {choice.describe()}"
    # the backward reads them so too (the output gradient and the saved output also by delta's
    # fused reduction), its dense rows by asynchronous copies
    impl = _build(_spec("bf16"), backward=True)
    (backward,) = impl.backward
    flash = "backward, mma m16n8k16 bf16, async copies, storage bf16 bits, accumulate f32, atomic"
    assert backward.choice_for(64, 64).describe() == flash
    staged = "backward, mma m16n8k16 bf16, storage bf16 bits, accumulate f32, atomic"
    assert backward.choice_for(64, 64, dense=False).describe() == staged
    assert impl.bf16_bits == {0, 1, 2, 3, 5}  # q, k, v, the saved output, d_out (the log-sum-exp is float32)


def test_float32_runs_3xtf32_by_default_and_one_tf32_product_when_opted_in():
    from attncomp.backends.numba_cuda.mma.atoms import M16N8K8_TF32

    (kernels,) = _build(_spec()).attention
    choice = kernels.choice_for(64, 64)
    assert (choice.atom, choice.operands, choice.exact, choice.products) == (M16N8K8_TF32, "tf32", True, "3xtf32")
    assert "mma m16n8k8 3xtf32" in kernels.source(64, 64).splitlines()[0]
    # 3xTF32 past D = 64 would spill: those head dims run the FMA kernel
    assert kernels.choice_for(128, 128).atom is None
    tf32 = IEEE.replace("precision=ieee", "precision=tf32")
    (one,) = _build(_spec(), tf32).attention
    assert (one.choice.operands, one.choice.exact) == ("tf32", False)
    assert one.choice_for(128, 128).describe() == "forward, mma m16n8k8 tf32, storage f32, accumulate f32, atomic"


def test_precision_ieee_runs_the_scalar_kernels():
    (kernels,) = _build(_spec(), IEEE).attention
    assert kernels.choice.atom is None and not kernels.choice.mma
    assert kernels.source(64, 64).splitlines()[0] == "# kernel: forward, fma, storage f32, accumulate f32, atomic"
    (backward,) = _build(_spec(), IEEE, backward=True).backward
    assert backward.choice_for(64, 64).describe() == "backward, fma, storage f32, accumulate f32, atomic"


@pytest.mark.parametrize(
    "dtype,kind",
    [
        ("f32", "mma m16n8k8 3xtf32, storage f32"),
        ("f16", "mma m16n8k16 f16, async copies, storage f16"),
        ("bf16", "mma m16n8k16 bf16, async copies, storage bf16 bits"),
    ],
)
def test_a_deterministic_backward_runs_a_key_major_kernel_and_a_dq_pass(dtype, kind):
    """On tensor cores (``mma/deterministic.py``): f16 and bf16 on the asynchronous-copy design (bf16
    from its 16-bit patterns), float32 on the staged one (3xTF32)."""
    (kernels,) = _build(_spec(dtype), backward=True, deterministic=True).backward
    choice = kernels.choice_for(64, 64)
    assert choice.deterministic and choice.mma and choice.async_copies == (dtype != "f32")
    first, second = kernels.source(64, 64).splitlines()[:2]
    assert first == f"# kernel: backward, {kind}, accumulate f32, deterministic"
    assert second == f"# kernel: dq pass, {kind}, accumulate f32, deterministic"


def test_decode_calls_and_wide_heads_fall_back_to_the_scalar_kernels():
    (kernels,) = _build(_spec("f16")).attention
    assert kernels.choice_for(64, 64).operands == "f16" and kernels.choice_for(64, 64).storage == "f16"
    decode = kernels.choice_for(64, 64, rows=1)  # one query row: no warp of 16 rows
    assert decode.atom is None and decode.storage == "f16"
    assert kernels.source(64, 64, 1).splitlines()[0] == "# kernel: forward, fma, storage f16, accumulate f32, atomic"
    assert kernels.choice_for(256, 256).atom is None  # past 128 the tensor-core kernel would spill


def test_fn_kernels_lists_each_attention_kernels_choice():
    fn = ac.compile(_spec("bf16"), backend="cuda")
    listed = {k.name: k for k in fn.kernels(64, 64)}
    forward = listed["attention_kernel_0[D=64,E=64]"]
    assert (
        forward.choice.describe()
        == "forward, mma m16n8k16 bf16, async copies, storage bf16 bits, accumulate f32, atomic"
    )
    assert forward.source.startswith(forward.choice.header() + "\n")
    assert all(k.choice is None for name, k in listed.items() if not name.startswith("attention_"))
    backward = ac.compile(_spec(), backend="cuda", deterministic=True).backward
    choices = {k.name: k.choice for k in backward.kernels(64, 64) if k.choice is not None}
    assert choices["attention_backward_kernel_0_dq[D=64,E=64]"].family == "dq pass"
    assert choices["attention_backward_kernel_0[D=64,E=64]"].deterministic
    with pytest.raises(ValueError, match="cuda"):
        ac.compile(_spec(), backend="interp").kernels()
