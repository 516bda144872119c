"""The command line of a benchmark whose rows run on a device (``benchmarks.flex``, ``benchmarks.flash_attn``):
``--device``, ``--quick``, ``--repeats`` and ``--compile-only``, and no GPU said, not failed."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def main(
    doc: str | None,
    rows: Callable[[bool, int, str], list[str]],
    warm: Callable[[str, bool], str],
    argv: list[str] | None = None,
) -> int:
    """Print ``rows(quick, repeats, device)``, or with ``--compile-only`` ``warm(device, quick)``."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--quick", action="store_true", help="smaller sizes")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--compile-only", action="store_true", help="one untimed call of each side")
    args = parser.parse_args(argv)
    if args.device == "cuda":
        from benchmarks.gpu import gpu_or_reason

        reason = gpu_or_reason()
        if reason is not None:
            print(f"no GPU: {reason}")
            return 0
    if args.compile_only:
        print(warm(args.device, args.quick))
        return 0
    for line in rows(args.quick, args.repeats, args.device):
        print(line)
    return 0
