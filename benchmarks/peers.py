"""The peers attncomp is measured against: numpy and PyTorch's SDPA on the CPU."""

from __future__ import annotations

import os

import numpy as np


def numpy_attention(q, k, v, mask=None) -> np.ndarray:
    """softmax(q kᵀ / sqrt(d)) v with a dense boolean mask, one (batch, head) at a time."""
    out = np.empty(q.shape[:-1] + (v.shape[-1],), dtype=q.dtype)
    scale = q.shape[-1] ** -0.5
    n_rep = q.shape[1] // k.shape[1]
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            s = (q[b, h] @ k[b, h // n_rep].T) * scale
            if mask is not None:
                s = np.where(mask, s, -np.inf)
            s = np.exp(s - s.max(axis=-1, keepdims=True))
            out[b, h] = (s / s.sum(axis=-1, keepdims=True)) @ v[b, h // n_rep]
    return out


def torch_or_none():
    try:
        import torch
    except ImportError:
        return None
    torch.set_num_threads(2)
    return torch


def blas_kernels() -> str:
    """Which kernels SciPy's OpenBLAS (the CPU backend's tile products) runs, and why: its own
    choice for this CPU, or ``OPENBLAS_CORETYPE`` from the environment.  The tiles' speed depends
    on it (Haswell's 256-bit kernels or SkylakeX's 512-bit ones on an AVX-512 CPU)."""
    from attncomp.backends.numba_cpu import intrinsics

    kernels = intrinsics.blas_kernels()
    if kernels is None:
        return "SciPy's BLAS: unknown kernels"
    chosen = os.environ.get("OPENBLAS_CORETYPE")
    why = f"OPENBLAS_CORETYPE={chosen} set in the environment" if chosen else "its choice for this CPU"
    return f"SciPy's OpenBLAS kernels: {kernels} ({why})"


def torch_attention(torch, q, k, v, causal=False, mask=None, gqa=False):
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
    attn_mask = None if mask is None else torch.from_numpy(mask)
    extra = {"enable_gqa": True} if gqa else {}
    with torch.no_grad():
        return torch.nn.functional.scaled_dot_product_attention(
            tq, tk, tv, attn_mask=attn_mask, is_causal=causal, **extra
        ).numpy()
