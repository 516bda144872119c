"""The context-parallel cases: specs, whole inputs (one seed) and which axis of each argument is sharded."""

import json
import os
import time

import numpy as np

import attncomp as ac

B, H, T, D = 2, 2, 64, 16


@ac.spec
def generic_causal(
    q: ac.floating["B", "H", "T", "D"], k: ac.floating["B", "H", "S", "D"], v: ac.floating["B", "H", "S", "D"]
):
    s = (q @ k.mT) * q.shape[-1] ** -0.5
    b, h, i, j = ac.index(s)
    s = ac.where(j <= i, s, -ac.inf)
    return ac.softmax(s, axis=-1) @ v, ac.max(s, axis=-1)  # each row's max score: merged across ranks


@ac.spec
def projected(
    x: ac.f32["B", "H", "T", "D"], w: ac.f32["D", "D"], k: ac.f32["B", "H", "S", "D"], v: ac.f32["B", "H", "S", "D"]
):
    q = x @ w
    s = (q @ k.mT) * x.shape[-1] ** -0.5
    return ac.softmax(s, axis=-1) @ v


def _qkv(rng: np.random.Generator) -> list[np.ndarray]:
    return [rng.standard_normal((B, H, T, D)).astype(np.float32) for _ in range(3)]


def _documents(rng: np.random.Generator) -> np.ndarray:
    doc = np.zeros((B, T), dtype=np.int32)
    for b in range(B):
        doc[b, rng.choice(np.arange(1, T), size=3, replace=False)] = 1
    return np.cumsum(doc, axis=1).astype(np.int32)


def _spec(name: str):
    from examples.alibi import causal_alibi
    from examples.causal import causal
    from examples.document_mask import causal_document_mask
    from examples.prefix_lm import prefix_lm
    from examples.sigmoid_attention import causal_sigmoid
    from examples.sliding_window import causal_sliding_window

    return {
        "causal": causal,
        "window": causal_sliding_window,
        "documents": causal_document_mask,
        "alibi": causal_alibi,
        "prefix": prefix_lm,
        "bf16": generic_causal,
        "sigmoid": causal_sigmoid,
    }[name]


#: per case: the spec, its constants, the extra inputs and the sharded axis of each argument
CASES: dict[str, dict] = {
    "causal": {"spec": "causal", "extra": [], "sharded": [-2, -2, -2]},
    "window": {"spec": "window", "constants": {"window": 12}, "extra": [], "sharded": [-2, -2, -2]},
    "documents": {"spec": "documents", "extra": ["doc"], "sharded": [-2, -2, -2, -1]},
    "alibi": {"spec": "alibi", "constants": {"window": 40}, "extra": ["slopes"], "sharded": [-2, -2, -2, None]},
    "prefix": {"spec": "prefix", "extra": ["prefix"], "sharded": [-2, -2, -2, None]},
    "bf16": {"spec": "bf16", "dtype": "bf16", "extra": [], "sharded": [-2, -2, -2]},
    "sigmoid": {"spec": "sigmoid", "extra": [], "sharded": [-2, -2, -2]},  # partial results that add up
    "causal-contiguous": {"spec": "causal", "extra": [], "sharded": [-2, -2, -2], "chunks_per_rank": 1},
}


def inputs(case: dict) -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    args = _qkv(rng)
    for extra in case["extra"]:
        if extra == "doc":
            args.append(_documents(rng))
        elif extra == "slopes":
            args.append(np.array([0.25, 0.0625], dtype=np.float32))
        elif extra == "prefix":
            args.append(np.array([T // 3, 5], dtype=np.int32))
    return args


def spec_of(case: dict) -> ac.Spec:
    """The spec a case calls."""
    return _spec(case["spec"])


def build(case: dict, world: int):
    """The compiled function, its whole inputs and the output's cotangent."""
    fn = ac.compile(_spec(case["spec"]), backend="cpu", **case.get("constants", {}))
    args = inputs(case)
    cotangent = np.random.default_rng(11).standard_normal((B, H, T, D)).astype(np.float32)
    return fn, args, cotangent


def run_error_case(name: str, world: int, rank: int, out: str) -> None:
    """Each rank saves the error its call raised, and how long it took."""
    import torch

    import attncomp.distributed as acd

    fn = ac.compile(_spec("causal"), backend="cpu")
    args = inputs(CASES["causal"])
    layout = acd.balance(fn, world, *args)
    cp = acd.context_parallel(fn, layout, timeout=3 if name == "error-timeout" else 60)
    shards = [layout.shard(torch.from_numpy(x), rank) for x in args]
    if name == "error-length" and rank == world - 1:
        shards[1] = shards[1][..., 1:, :]  # one position short on the last rank
    if name == "error-heads" and rank == 0:
        shards = [s[:, :1] for s in shards]  # rank 0 believes there is one head
    start = time.perf_counter()
    message = ""
    try:
        if not (name == "error-timeout" and rank != 0):  # only rank 0 calls: its peers never come
            cp(*shards)
    except Exception as error:
        message = f"{type(error).__name__}: {error}"
    record = {"message": message, "seconds": time.perf_counter() - start}
    with open(os.path.join(out, f"{name}-{rank}.json"), "w") as f:
        json.dump(record, f)


@ac.spec
def centred_keys(q: ac.f32["B", "H", "T", "D"], k: ac.f32["B", "H", "T", "D"], v: ac.f32["B", "H", "T", "D"]):
    k = k - ac.sum(k, 2, keepdims=True)
    return ac.softmax(q @ k.mT) @ v
