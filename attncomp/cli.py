"""The ``attncomp`` command line: print IR, check a spec against the interpreter."""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from attncomp.api import compile, interpret
from attncomp.dsl import Spec
from attncomp.errors import AttncompError
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
    if not (args.print_after_all or args.print_after or args.timing or args.pipeline is not None):
        print(spec.trace(**constants) if constants else spec.ir, end="")
        return 0
    fn = compile(spec, backend="interp", pipeline=args.pipeline, **constants)
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="attncomp", description="A compiler for attention kernels.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    ir = sub.add_parser("ir", help="print the IR of a spec, optionally after each pass")
    ir.add_argument("target", metavar="FILE.py:SPEC")
    ir.add_argument("--print-after-all", action="store_true", help="print the IR after every pass")
    ir.add_argument("--print-after", metavar="PASS", help="print the IR after PASS")
    ir.add_argument("--pipeline", help="passes to run (default: the optimising pipeline)")
    ir.add_argument("--timing", action="store_true", help="print how long each pass took")
    ir.add_argument("--const", metavar="NAME=INT,...", help="override keyword-only constants")
    ir.set_defaults(run=cmd_ir)

    check = sub.add_parser("check", help="run a spec on random inputs against the reference interpreter")
    check.add_argument("target", metavar="FILE.py:SPEC")
    check.add_argument("--dims", required=True, metavar="NAME=INT,...", help="sizes, e.g. B=1,H=2,T=64")
    check.add_argument("--backend", default="interp", help="backend to check (default: interp)")
    check.add_argument("--pipeline", help="passes to run (default: the optimising pipeline)")
    check.add_argument("--const", metavar="NAME=INT,...", help="override keyword-only constants")
    check.add_argument("--seed", type=int, default=0)
    check.add_argument("--tol", type=float, help="relative error bound (default: by result type)")
    check.set_defaults(run=cmd_check)
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
