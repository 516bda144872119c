"""The ``attncomp`` command line: print IR, check a spec against the interpreter."""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from attncomp.api import compile, interpret
from attncomp.dsl import Spec
from attncomp.errors import AttncompError
from attncomp.plot import plot_block_map, require_matplotlib
from attncomp.testing import random_inputs, tolerance_for, worst_error


class UsageError(AttncompError):
    """A command line that cannot be carried out; printed, exit status 2."""


def load_spec(target: str) -> Spec:
    """``FILE.py:SPEC`` -> the spec object named SPEC in FILE.py."""
    path_text, sep, name = target.rpartition(":")
    if not sep or not path_text or not name:
        raise UsageError(f"expected FILE.py:SPEC, got {target!r}")
    path = Path(path_text)
    if not path.is_file():
        raise UsageError(f"no such file: {path}")
    module_name = f"_attncomp_user_{abs(hash(path.resolve()))}"
    loader = importlib.util.spec_from_file_location(module_name, path)
    if loader is None or loader.loader is None:
        raise UsageError(f"cannot import {path}")
    module = importlib.util.module_from_spec(loader)
    sys.modules[module_name] = module
    loader.loader.exec_module(module)
    found = getattr(module, name, None)
    if not isinstance(found, Spec):
        specs = [k for k, v in vars(module).items() if isinstance(v, Spec)]
        raise UsageError(f"{path} has no spec {name!r}; specs there: {', '.join(specs) or 'none'}")
    return found


def parse_assignments(text: str | None, what: str) -> dict[str, int]:
    """``B=1,H=8`` -> {"B": 1, "H": 8}."""
    out: dict[str, int] = {}
    for item in filter(None, (text or "").split(",")):
        key, sep, value = item.partition("=")
        try:
            out[key.strip()] = int(value)
        except ValueError:
            raise UsageError(f"{what}: expected NAME=INT, got {item!r}") from None
        if not sep:
            raise UsageError(f"{what}: expected NAME=INT, got {item!r}")
    return out


def cmd_ir(args: argparse.Namespace) -> int:
    spec = load_spec(args.target)
    constants = parse_assignments(args.const, "--const")
    if not (args.print_after_all or args.print_after or args.timing or args.backward or args.pipeline is not None):
        print(spec.trace(**constants) if constants else spec.ir, end="")
        return 0
    fn = compile(spec, backend="interp", pipeline=args.pipeline, **constants)
    if args.backward:
        fn = fn.backward
    if args.print_after_all:
        print(fn.dump(), end="")
    elif args.print_after:
        print(fn.ir(args.print_after), end="")
    else:
        print(fn.ir("final"), end="")
    if args.timing:
        print("// pass timings")
        for name, seconds in fn.timings:
            print(f"//   {name:<20} {seconds * 1e3:8.3f} ms")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    spec = load_spec(args.target)
    constants = parse_assignments(args.const, "--const")
    sizes = parse_assignments(args.dims, "--dims")
    fn = compile(spec, backend=args.backend, pipeline=args.pipeline, **constants)
    reference_module = spec.trace(**constants) if constants else spec.ir
    try:
        inputs = random_inputs(reference_module.main, sizes, seed=args.seed)
    except KeyError as exc:
        raise UsageError(f"--dims: {exc.args[0]}") from None
    start = time.perf_counter()
    results = fn(*inputs)
    backend_s = time.perf_counter() - start
    start = time.perf_counter()
    references = interpret(reference_module, *inputs)
    reference_s = time.perf_counter() - start
    as_list = lambda r: list(r) if isinstance(r, tuple) else [r]  # noqa: E731
    error = worst_error(as_list(results), as_list(references))
    tol = args.tol if args.tol is not None else tolerance_for([t.dtype for t in fn.func.result_types])
    ok = error <= tol
    print(f"{spec.name} on {args.backend} [{', '.join(fn.stages) or 'no passes'}]")
    print(f"  sizes: {', '.join(f'{k}={v}' for k, v in sizes.items())}")
    print(f"  relative error {error:.3e} (tolerance {tol:.1e}): {'ok' if ok else 'MISMATCH'}")
    print(f"  time: {backend_s * 1e3:.3f} ms on {args.backend}, {reference_s * 1e3:.3f} ms reference")
    return 0 if ok else 1


def cmd_bench(args: argparse.Namespace) -> int:
    spec = load_spec(args.target)
    constants = parse_assignments(args.const, "--const")
    sizes = parse_assignments(args.dims, "--dims")
    start = time.perf_counter()
    fn = compile(spec, backend=args.backend, pipeline=args.pipeline, **constants)
    try:
        inputs = random_inputs(fn.func, sizes, seed=args.seed)
    except KeyError as exc:
        raise UsageError(f"--dims: {exc.args[0]}") from None
    fn(*inputs)
    first = time.perf_counter() - start
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        fn(*inputs)
        times.append(time.perf_counter() - start)
    times.sort()
    print(f"{spec.name} on {args.backend} [{', '.join(fn.stages) or 'no passes'}]")
    print(f"  sizes: {', '.join(f'{k}={v}' for k, v in sizes.items())}")
    print(f"  compile and first call: {first * 1e3:.1f} ms")
    print(f"  {args.repeats} calls: min {times[0] * 1e3:.3f} ms, median {times[len(times) // 2] * 1e3:.3f} ms")
    return 0


#: one character per tile class in ``attncomp blocks``: skipped, masked, full
TILE_CHARS = ".m#"


def block_sizes(func) -> tuple[int | None, int | None]:
    """``block_q`` of the first ``ac.tile_grid`` and ``block_k`` of its key loop."""
    for grid in (op for op in func.body.ops if op.name == "ac.tile_grid"):
        loops = [op for region in grid.regions for op in region.walk() if op.name == "ac.tile_for"]
        return grid.attrs.get("block_q"), loops[0].attrs.get("block_k") if loops else None
    return None, None


def tile_grid_text(tiles: np.ndarray) -> str:
    """One line per query block, one character per key block."""
    return "\n".join("".join(TILE_CHARS[c] for c in row) for row in tiles)


def cmd_blocks(args: argparse.Namespace) -> int:
    if args.png:
        try:
            require_matplotlib("attncomp blocks --png")
        except ImportError as exc:
            raise UsageError(str(exc)) from None
    spec = load_spec(args.target)
    constants = parse_assignments(args.const, "--const")
    sizes = parse_assignments(args.dims, "--dims")
    fn = compile(spec, backend="interp", pipeline=args.pipeline, **constants)
    try:
        inputs = random_inputs(fn.func, sizes, seed=args.seed)
    except KeyError as exc:
        raise UsageError(f"--dims: {exc.args[0]}") from None
    tiles = fn.block_map(*inputs)
    leading = tiles.ndim - 2
    chosen = [("batch", args.batch), ("head", args.head)][:leading]
    for axis, (what, index) in enumerate(chosen):
        if not 0 <= index < tiles.shape[axis]:
            raise UsageError(f"--{what} {index}: the block map has {tiles.shape[axis]} along {what}")
    shown = tiles[tuple(index for _, index in chosen)]
    block_q, block_k = block_sizes(fn.func)
    counts = [int(np.count_nonzero(tiles == c)) for c in range(3)]
    computed = (counts[1] + counts[2]) / max(tiles.size, 1)
    where = ", ".join(f"{what} {index}" for what, index in chosen)
    print(f"{spec.name} [{', '.join(fn.stages) or 'no passes'}]")
    print(f"  sizes: {', '.join(f'{k}={v}' for k, v in sizes.items())}")
    print(f"  blocks: {block_q} queries x {block_k} keys; map {'x'.join(map(str, tiles.shape))}")
    print(f"  tiles: {counts[0]} skipped (.), {counts[1]} masked (m), {counts[2]} full (#); {computed:.1%} computed")
    print(f"{where or 'map'}: query blocks down, key blocks across")
    print(tile_grid_text(shown))
    if args.png:
        title = f"{spec.name}: tiles" + (f", {where}" if where else "") + f" ({computed:.1%} computed)"
        plot_block_map(shown, args.png, title, block_q, block_k)
        print(f"wrote {args.png}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="attncomp", description="A compiler for attention kernels.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help: str, run, dims_example: str | None = None) -> argparse.ArgumentParser:
        """A subcommand on FILE.py:SPEC with the options every command shares."""
        cmd = sub.add_parser(name, help=help)
        cmd.add_argument("target", metavar="FILE.py:SPEC")
        if dims_example:
            cmd.add_argument("--dims", required=True, metavar="NAME=INT,...", help=f"sizes, e.g. {dims_example}")
        cmd.add_argument("--pipeline", help="passes to run (default: the optimising pipeline)")
        cmd.add_argument("--const", metavar="NAME=INT,...", help="override keyword-only constants")
        cmd.set_defaults(run=run)
        return cmd

    ir = command("ir", "print the IR of a spec, optionally after each pass", cmd_ir)
    ir.add_argument("--print-after-all", action="store_true", help="print the IR after every pass")
    ir.add_argument("--print-after", metavar="PASS", help="print the IR after PASS")
    ir.add_argument("--timing", action="store_true", help="print how long each pass took")
    ir.add_argument("--backward", action="store_true", help="the backward (autodiff) instead of the forward")

    check = command("check", "run a spec on random inputs against the reference interpreter", cmd_check, "B=1,H=2,T=64")
    check.add_argument("--backend", default="interp", help="backend to check (default: interp)")
    check.add_argument("--seed", type=int, default=0)
    check.add_argument("--tol", type=float, help="relative error bound (default: by result type)")

    bench = command("bench", "time a spec on random inputs", cmd_bench, "B=1,H=8,T=1024")
    bench.add_argument("--backend", default="cpu", help="backend to time (default: cpu)")
    bench.add_argument("--repeats", type=int, default=10)
    bench.add_argument("--seed", type=int, default=0)

    blocks = command(
        "blocks", "print which tiles are skipped, masked or full (fn.block_map)", cmd_blocks, "B=1,H=1,T=1024"
    )
    blocks.add_argument("--batch", type=int, default=0, help="batch entry to show (default: 0)")
    blocks.add_argument("--head", type=int, default=0, help="head to show (default: 0)")
    blocks.add_argument("--png", metavar="PATH", help="also draw the grid (needs the plot extra)")
    blocks.add_argument("--seed", type=int, default=0)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (AttncompError, TypeError, ValueError, KeyError) as exc:
        # str() of a KeyError is the repr of its message; print the message itself
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"attncomp: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
