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
- The torch package (``attncomp/torch/``) asks the ``Program``, never the backend's name, and imports
  no backend; a private torch name is read only where docs/architecture.md lists it, with why.
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
    "torch": 5,
    "api": 6,
    "plot": 6,
    "attncomp": 7,
    "cli": 7,
    "hf": 7,
    "sdpa": 7,
    "sigmoid_attention": 7,
    "flex": 7,
    "flash_attn": 7,
    "fuzz": 7,
    "fuzz_paths": 7,
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


#: the Numba (and PyTorch) internals a module reads, where the library offers no public way (listed in
#: docs/architecture.md)
LIBRARY_INTERNALS = {
    # PyTorch's count of a tensor's in-place changes: a float mask's boolean form kept for one forward
    "attncomp/hf/attention.py": {"mask._version"},
    # a cache locator of attncomp's own
    "attncomp/backends/cache.py": {"caching.CacheImpl._locator_classes"},
    # code run before a cached function loads (its shared tile code provided)
    "attncomp/backends/numba_cpu/shared_calls.py": {"context.active_code_library._reload_init"},
    # the data layout Numba's per-function passes set, set without them
    "attncomp/backends/function_passes.py": {"self._codegen", "self._codegen._data_layout"},
    # numba-cuda's shape-and-strides model of a device array, which its own views are made from
    "attncomp/backends/numba_cuda/host/arrays.py": {"x._dummy"},
    # the post-processor's own del insertion, run where its callers ask for it
    "attncomp/backends/lazy_lifetimes.py": {"self._insert_var_dels"},
    # the SSA module's pieces the one-pass reconstruction runs, unchanged
    "attncomp/backends/ssa_fix.py": {
        f"ssa.{name}"
        for name in (
            "_CacheListVars",
            "_compute_phi_locations",
            "_find_defs_violators",
            "_FixSSAVars",
            "_FreshVarHandler",
            "_iterated_domfronts",
        )
    },
}


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
            if ast.unparse(node) in LIBRARY_INTERNALS.get(str(path.relative_to(ROOT)), ()):
                continue
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
CUDA_BACKEND_LINES = 400


def test_cuda_backend_files_stay_small():
    long = [
        f"{path.relative_to(ROOT)}: {n} lines"
        for path in sorted((PACKAGE / "backends" / "numba_cuda").rglob("*.py"))
        if (n := len(path.read_text().splitlines())) > CUDA_BACKEND_LINES
    ]
    assert not long, f"split these (over {CUDA_BACKEND_LINES} lines):\n" + "\n".join(long)


#: the kernel writers of the CUDA backend, by the module that defines them
CUDA_WRITER_MODULES = ("simt", "mma")


def writer_classes() -> dict[str, tuple[str, list[str]]]:
    """Every class of ``numba_cuda/simt/`` and ``numba_cuda/mma/``: name -> (module, base names)."""
    found = {}
    for room in CUDA_WRITER_MODULES:
        for path in sorted((PACKAGE / "backends" / "numba_cuda" / room).glob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef):
                    bases = [b.id if isinstance(b, ast.Name) else ast.unparse(b) for b in node.bases]
                    found[node.name] = (f"{room}/{path.name}", bases)
    return found


def test_no_kernel_writer_per_precision():
    """A float32 precision (TF32, 3xTF32) or a 16-bit type is an operand policy the one forward and the
    one backward tensor-core writer take (``mma/operands.py``), not a writer subclass: no tensor-core
    writer derives from another but the asynchronous-copy variants (forward and backward) and the
    deterministic backward's two kernels over each backward design (``mma/deterministic.py``: a
    key-major and a query-major mixin), and no writer is named for a type."""
    classes = writer_classes()
    names = re.compile(r"(Tf32|F16|Bf16|Half|Float32|Exact)", re.I)
    assert not [n for n in classes if "Writer" in n and names.search(n)], "a writer named for an operand type"
    mma_writers = {n for n, (module, _) in classes.items() if module.startswith("mma/") and n.endswith("Writer")}
    derived = {n: [b for b in bases if b in mma_writers] for n, (_, bases) in classes.items() if n in mma_writers}
    flash = {"FlashKernelWriter": ["MmaKernelWriter"], "FlashBackwardWriter": ["MmaBackwardKernelWriter"]}
    for design, writer in (("Flash", "FlashBackwardWriter"), ("Staged", "MmaBackwardKernelWriter")):
        for kernel, mixin in (("Deterministic", "DeterministicKeys"), ("Dq", "QueryMajorDq")):
            flash[f"{design}{kernel}Writer"] = [writer]
            assert classes[f"{design}{kernel}Writer"] == ("mma/deterministic.py", [mixin, writer])
    assert {n: b for n, b in derived.items() if b} == flash
    assert "Operands" in classes and classes["Operands"][0] == "mma/operands.py"


# the torch package -----------------------------------------------------------------------------
TORCH_PACKAGE = PACKAGE / "torch"


def asks_backend_name(node: ast.AST) -> bool:
    """Whether ``node`` is a backend's name: ``x.backend`` or a variable ``backend``."""
    return (isinstance(node, ast.Attribute) and node.attr == "backend") or (
        isinstance(node, ast.Name) and node.id == "backend"
    )


def test_the_torch_package_never_asks_the_backend_name():
    """``attncomp/torch/`` asks the ``Program`` (``device_type``, ``on_stream``, ``bf16_patterns``), never
    which backend it has: no comparison or lookup by the backend's name (a message may say it), no
    import of a backend's package."""
    wrong = []
    for path in sorted(TORCH_PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare) and any(asks_backend_name(n) for n in (node.left, *node.comparators)):
                wrong.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
            elif isinstance(node, ast.Subscript) and asks_backend_name(node.slice):
                wrong.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
            elif isinstance(node, ast.Call) and ast.unparse(node.func).endswith(".get"):
                if any(asks_backend_name(a) for a in node.args):
                    wrong.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
        for line, target in imported_modules(tree):
            if backend_of(target) is not None:
                wrong.append(f"{path.relative_to(ROOT)}:{line}: imports {target}")
    assert not wrong, "the torch package asks which backend it has (ask the Program):\n" + "\n".join(wrong)


TORCH_NAME = re.compile(r"^torch(\.\w+)+$")


def is_private_torch_name(name: str) -> bool:
    return bool(TORCH_NAME.match(name)) and any(
        part.startswith("_") and not part.startswith("__") for part in name.split(".")
    )


def private_torch_names(tree: ast.Module) -> set[str]:
    """The private torch names a module reads: ``torch._x`` attributes and imports, module paths given as
    strings, and (module, name) pairs or ``getattr(import_module(module), name)`` looked up by name."""
    found: set[str] = set()
    paired: set[int] = set()

    def text(node: ast.AST) -> str | None:
        return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None

    for node in ast.walk(tree):
        pair = None
        if isinstance(node, ast.Tuple) and len(node.elts) == 2:
            pair = node.elts
        elif isinstance(node, ast.Call) and ast.unparse(node.func) == "getattr" and len(node.args) >= 2:
            inner = node.args[0]
            if isinstance(inner, ast.Call) and ast.unparse(inner.func).endswith("import_module") and inner.args:
                pair = [inner.args[0], node.args[1]]
        if pair is not None and text(pair[0]) and TORCH_NAME.match(text(pair[0])) and text(pair[1]):
            name = f"{text(pair[0])}.{text(pair[1])}"
            if is_private_torch_name(name):
                found.add(name)
                paired.add(id(pair[0]))
        if isinstance(node, ast.Attribute) and is_private_torch_name(ast.unparse(node)):
            found.add(ast.unparse(node))
        elif isinstance(node, ast.ImportFrom) and is_private_torch_name(node.module or ""):
            found |= {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if is_private_torch_name(a.name)}
    for node in ast.walk(tree):  # module paths given alone
        if id(node) not in paired and text(node) and is_private_torch_name(text(node)):
            found.add(text(node))
    # an attribute chain counts once, at its longest
    return {n for n in found if not any(other.startswith(n + ".") for other in found)}


def listed_private_torch_names() -> set[str]:
    """The names in the table under "Private torch names" in docs/architecture.md."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("### Private torch names", 1)[1].split("\n#", 1)[0]
    return {m for m in re.findall(r"^\| `([^`]+)` \|", section, flags=re.M)}


def test_private_torch_names_are_listed_with_their_reason():
    """A private torch name is read only where torch offers no public one, and each is listed, with
    why, in docs/architecture.md; a name listed there is one still read."""
    found = {}
    for path in sources():
        for name in private_torch_names(ast.parse(path.read_text())):
            found.setdefault(name, []).append(str(path.relative_to(ROOT)))
    listed = listed_private_torch_names()
    unlisted = {name: paths for name, paths in found.items() if name not in listed}
    assert not unlisted, f"list these in docs/architecture.md (Private torch names), or use a public name: {unlisted}"
    assert listed <= set(found), f"docs/architecture.md lists names no longer read: {sorted(listed - set(found))}"


def test_private_torch_names_are_found():
    """The search above finds each form a name may take (so the listing check can fail)."""
    source = """
import torch._dynamo
from torch.utils._python_dispatch import TorchDispatchMode
x = torch._C._foo()
CHECKS = (("torch._C", "_bar"),)
y = getattr(importlib.import_module("torch._C"), "_baz", None)
z = importlib.import_module("torch._inductor")
w = torch.cuda.current_stream()
"""
    assert private_torch_names(ast.parse(source)) == {
        "torch._dynamo",
        "torch.utils._python_dispatch.TorchDispatchMode",
        "torch._C._foo",
        "torch._C._bar",
        "torch._C._baz",
        "torch._inductor",
    }
