"""Building and running the CUDA backend in the simulator tests."""

# (no ``from __future__ import annotations``: a spec's dimension names would become forward references)
import numpy as np

import attncomp as ac

#: small blocks, so that the test sizes make skipped, masked, full and partial tiles
PIPELINE = "cse,softmax-fusion,flash-tiling{block_q=8,block_k=8},mask-elimination,canonicalize,cse,dce"


def build_cuda(spec, pipeline: str = PIPELINE, lanes: int | None = None, split: int | None = None, **constants):
    """(compiled function, CUDA build) for ``spec``: the pipeline runs as for ``ac.compile``."""
    from attncomp.backends import numba_cuda

    fn = ac.compile(spec, backend="interp", pipeline=pipeline, **constants)
    return fn, numba_cuda.build(fn.module, lanes=lanes, split=split)


def run_cuda(spec, inputs, pipeline: str = PIPELINE, lanes: int | None = None) -> list:
    fn, impl = build_cuda(spec, pipeline, lanes)
    result = impl.call(fn.func, inputs, fn.constraints)
    return list(result) if isinstance(result, tuple) else [result]


def as_list(result) -> list:
    return list(result) if isinstance(result, tuple) else [result]


def host(x) -> np.ndarray:
    return x.copy_to_host() if hasattr(x, "copy_to_host") else np.asarray(x)


def retyped(spec, dtype: str):
    """``spec`` with its float32 arguments declared ``dtype`` (f16, bf16): the same function, traced
    again from its source in its module."""
    import inspect
    import sys
    import textwrap

    source = textwrap.dedent(inspect.getsource(spec.fn)).replace("ac.f32[", f"ac.{dtype}[")
    namespace = dict(vars(sys.modules[spec.fn.__module__]))
    exec(compile(source, f"<{spec.name} in {dtype}>", "exec"), namespace)
    return namespace[spec.fn.__name__]


def projected_attention() -> ac.Spec:
    """The nanochat layer's attention (projections, rotary embeddings, QK norm, GQA, causal) without
    its output projection, for every float type: its keys and values are computed, so a decoder
    caches what the spec computes.  Rotary embeddings compute in float32 (their frequencies are), and
    the query and key go back to the input's type, as a bf16 model keeps them."""
    from tests.conftest import load_example

    rope = load_example("rope_qknorm")  # the rotary and norm helpers of the nanochat layer

    @ac.spec
    def projected(
        x: ac.floating["B", "T", "C"],  # noqa: F821
        w_q: ac.floating["C", "HD"],  # noqa: F821
        w_k: ac.floating["C", "KVD"],  # noqa: F821
        w_v: ac.floating["C", "KVD"],  # noqa: F821
        *,
        n_head: int = 2,
        n_kv_head: int = 1,
    ):
        B, T, C = x.shape
        d = w_q.shape[1] // n_head
        q = (x @ w_q).reshape(B, T, n_head, d).transpose(1, 2)
        k = (x @ w_k).reshape(B, T, n_kv_head, d).transpose(1, 2)
        v = (x @ w_v).reshape(B, T, n_kv_head, d).transpose(1, 2)
        q = rope.rms_norm(rope.apply_rotary_emb(q, 10000.0), 2.0**-23).astype(x.dtype)
        k = rope.rms_norm(rope.apply_rotary_emb(k, 10000.0), 2.0**-23).astype(x.dtype)
        k, v = ac.repeat_kv(k, n_head // n_kv_head), ac.repeat_kv(v, n_head // n_kv_head)
        s = (q @ k.mT) * d**-0.5
        b, h, i, j = ac.index(s)
        s = ac.where(j <= i, s, -ac.inf)
        return ac.softmax(s, axis=-1) @ v

    return projected


def normal(rng, *shape, dtype=np.float32) -> np.ndarray:
    return rng.standard_normal(shape).astype(dtype)


def check_gradients(got, want, args, tolerance: float) -> None:
    """One gradient per argument (None where the reference has none), each of its argument's shape
    and type, non-zero in the reference, within ``tolerance`` relative error of it."""
    from attncomp.testing import relative_error

    assert len(got) == len(want) == len(args)
    for g, w, a in zip(got, want, args):
        if w is None:
            assert g is None
            continue
        assert g.shape == a.shape and g.dtype == a.dtype
        assert np.abs(w).max() > 0  # a gradient that is there to compare
        assert relative_error(g, w) < tolerance
