"""Backends: lowering of the final IR to runnable code."""

BACKENDS = ("interp", "cpu", "cuda")
