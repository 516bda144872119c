"""The house rules, checked on the source: layers, private names, links.

- A module imports only modules of its own layer or below (type-only imports excepted), so
  nothing imports back up at run time: ir, tracing and passes, backends, the compilation,
  the features built on it, the public API, the entry points.
- A backend never imports the passes (what it generates code from is a stage of the pipeline, and
  IR helpers it needs live in ir/), and one backend never imports another's package (what two
  backends share lives in attncomp/backends/ itself).
- No module reads another module's underscore names.
- The README, the docs and the docstrings point only to files that exist.
- No file of the CUDA backend (``attncomp/backends/numba_cuda/``, its rooms included) is over
  ``CUDA_BACKEND_LINES`` lines: a file that grows past it is split along what it holds.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "attncomp"

#: the layers, lowest first: the first name component under attncomp/ (or the module) -> its layer
LAYERS = {
    "errors": 0,
    "ir": 1,
    "names": 2,
    "tensor": 2,
    "dsl": 2,
    "functions": 2,
    "passes": 2,
    "blockmap": 2,
    "testing": 2,
    "backends": 3,
    "compilation": 4,
    "gradients": 5,
    "decoder": 5,
    "float_types": 5,
    "chunked": 5,
    "distributed": 5,
    "serving": 5,
    "torch_op": 5,
    "torch_eager": 5,
    "api": 6,
    "plot": 6,
    "attncomp": 7,
    "cli": 7,
    "hf": 7,
    "fuzz": 7,
    "__main__": 7,
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def part(module: str) -> str:
    names = module.split(".")
    return names[1] if len(names) > 1 else names[0]


def sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def runtime_imports(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, module) of every attncomp import not under ``if TYPE_CHECKING:``."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    found = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("attncomp"):
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("attncomp")]
    return found


def test_every_module_has_a_layer():
    missing = {part(module_name(p)) for p in sources()} - set(LAYERS)
    assert not missing, f"give these a layer in LAYERS: {sorted(missing)}"


def test_modules_import_only_their_layer_and_below():
    wrong = []
    for path in sources():
        here = module_name(path)
        for line, target in runtime_imports(ast.parse(path.read_text())):
            if LAYERS[part(target)] > LAYERS[part(here)]:
                wrong.append(f"{path.relative_to(ROOT)}:{line}: {part(here)} imports {target}")
    assert not wrong, "\n".join(wrong)


#: the backends' packages (or modules) under attncomp/backends/; the other modules there are shared
BACKEND_PACKAGES = ("interp", "numba_cpu", "numba_cuda")


def backend_of(module: str) -> str | None:
    """The backend package ``module`` is (or is in), None for the other modules."""
    names = module.split(".")
    if names[:2] != ["attncomp", "backends"] or len(names) < 3:
        return None
    return names[2] if names[2] in BACKEND_PACKAGES else None


def backend_sources() -> list[Path]:
    return sorted((PACKAGE / "backends").rglob("*.py"))


def imported_modules(tree: ast.Module) -> list[tuple[int, str]]:
    """``runtime_imports``, with ``from attncomp.x import y`` also as ``attncomp.x.y`` (y may be a module)."""
    found = runtime_imports(tree)
    names = {(node.lineno, node.module): node.names for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    return found + [(line, f"{module}.{a.name}") for line, module in found for a in names.get((line, module), [])]


def test_backends_do_not_import_passes():
    wrong = []
    for path in backend_sources():
        for line, target in imported_modules(ast.parse(path.read_text())):
            if target == "attncomp.passes" or target.startswith("attncomp.passes."):
                wrong.append(f"{path.relative_to(ROOT)}:{line}: imports {target}")
    assert not wrong, "a backend imports the passes (move IR helpers to attncomp/ir/):\n" + "\n".join(wrong)


def test_backends_do_not_import_one_another():
    wrong = []
    for path in backend_sources():
        here = backend_of(module_name(path))
        for line, target in imported_modules(ast.parse(path.read_text())):
            there = backend_of(target)
            if there is not None and there != here:
                wrong.append(f"{path.relative_to(ROOT)}:{line}: {here or 'a shared module'} imports {target}")
    assert not wrong, "a backend imports another (share it from attncomp/backends/):\n" + "\n".join(wrong)


def defined_private_names(tree: ast.Module) -> set[str]:
    """Underscore names a module defines: functions, classes, attributes assigned anywhere."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def test_no_module_reads_another_modules_private_names():
    wrong = []
    for path in sources():
        tree = ast.parse(path.read_text())
        own = defined_private_names(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("attncomp"):
                wrong += [f"{node.lineno}: imports {a.name}" for a in node.names if a.name.startswith("_")]
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
                continue
            base = node.value
            if isinstance(base, ast.Call) and ast.unparse(base.func) == "super":
                continue  # a subclass using what its base class provides
            if isinstance(base, ast.Name) and base.id == "sys":
                continue  # the standard library's own (sys._getframe)
            if ast.unparse(node) == "caching.CacheImpl._locator_classes":
                continue  # Numba has no public way to add a cache locator (backends/cache.py)
            if node.attr not in own:
                wrong.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not wrong, "\n".join(wrong)


LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
DOC_PATH = re.compile(r"\b((?:docs|examples|benchmarks|attncomp|tests)/[\w/.-]+\.(?:md|py))\b")


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "examples" / "README.md"]


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_markdown_links_point_to_files_that_exist(path):
    text = path.read_text()
    missing = []
    for target in LINK.findall(text):
        if "://" in target or target.startswith("mailto:"):
            continue
        if not (path.parent / target).exists():
            missing.append(target)
    prose = re.sub(r"```.*?```", "", text, flags=re.S)  # code blocks quote programs' output
    for target in DOC_PATH.findall(prose):
        if not (ROOT / target).exists() and not (path.parent / target).exists() and "NAME" not in target:
            missing.append(target)
    assert not missing, f"{path.name} points to missing files: {missing}"


def test_docstrings_point_to_files_that_exist():
    missing = []
    for path in [*sources(), *sorted((ROOT / "examples").glob("*.py")), *sorted((ROOT / "benchmarks").glob("*.py"))]:
        for target in DOC_PATH.findall(path.read_text()):
            if not (ROOT / target).exists() and "NAME" not in target:  # examples/NAME.py: a pattern
                missing.append(f"{path.relative_to(ROOT)}: {target}")
        assert "API.md" not in path.read_text().replace("docs/api.md", ""), f"{path}: cites API.md, not docs/api.md"
    assert not missing, "\n".join(missing)


#: the most lines a file of ``attncomp/backends/numba_cuda/`` (recursively) may have
CUDA_BACKEND_LINES = 450


def test_cuda_backend_files_stay_small():
    long = [
        f"{path.relative_to(ROOT)}: {n} lines"
        for path in sorted((PACKAGE / "backends" / "numba_cuda").rglob("*.py"))
        if (n := len(path.read_text().splitlines())) > CUDA_BACKEND_LINES
    ]
    assert not long, f"split these (over {CUDA_BACKEND_LINES} lines):\n" + "\n".join(long)
