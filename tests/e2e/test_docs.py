"""README.md and docs/*.md as tests: every relative link resolves, every Python snippet runs.

A page's ```python blocks run in order in one namespace (later blocks use what earlier ones
defined), from a temporary directory with the checkout's root on ``sys.path`` (so
``from examples.alibi import causal_alibi`` works and files a snippet writes land in the
temporary directory). A block that cannot run here carries a marker on the line before it::

    <!-- snippet: not run (needs a GPU) -->

with one of the reasons in ``REASONS``. Blocks whose imports need an optional extra that is not
installed are skipped saying so, and so are the page's later blocks. A ``>>>`` transcript runs
as a doctest in the page's namespace.
"""

from __future__ import annotations

import ast
import doctest
import importlib.util
import linecache
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# What a marker may say: the reasons a block cannot run in the test suite.
REASONS = (
    "needs a GPU",
    "needs a Dask cluster",
    "needs the network",
    "needs a model download",
    "a signature",
    "a fragment",
)

# Optional extras, by the top-level module a block imports (or a call that imports it).
EXTRAS = {"torch": "torch", "transformers": "hf", "dask": "dask", "distributed": "dask", "matplotlib": "plot"}
NEEDS_MODULE = {"plot_attention": "matplotlib"}

MARKER = re.compile(r"^\s*<!--\s*snippet:\s*not run \((?P<reason>[^)]*)\)\s*-->\s*$")
FENCE = re.compile(r"^(?P<indent>\s*)(?P<ticks>```+)(?P<lang>[\w+-]*)\s*$")


@dataclass
class Block:
    page: str  # relative to the root
    number: int  # 1-based among the page's python blocks
    line: int  # of the opening fence
    code: str
    marker: str | None  # the marker's reason, if the line before the fence holds one

    @property
    def label(self) -> str:
        return f"{self.page} block {self.number} (line {self.line})"


def relative(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def split_fences(text: str) -> tuple[list[tuple[str, int, str, str]], list[str]]:
    """(fenced blocks as (lang, opening line, code, line before), the page's lines outside fences)."""
    lines = text.splitlines()
    blocks, prose = [], []
    n = 0
    while n < len(lines):
        m = FENCE.match(lines[n])
        if not m:
            prose.append(lines[n])
            n += 1
            continue
        indent, ticks = len(m["indent"]), m["ticks"]
        end = n + 1
        while end < len(lines) and lines[end].strip() != ticks:
            end += 1
        body = [line[indent:] if not line[:indent].strip() else line for line in lines[n + 1 : end]]
        blocks.append((m["lang"], n + 1, "\n".join(body) + "\n", lines[n - 1] if n else ""))
        prose += [""] * (min(end, len(lines) - 1) - n + 1)  # keeps prose[i] on line i + 1
        n = end + 1
    return blocks, prose


def python_blocks(page: Path) -> list[Block]:
    fenced, _ = split_fences(page.read_text())
    out = []
    for lang, line, code, before in fenced:
        if lang != "python":
            continue
        m = MARKER.match(before)
        out.append(Block(relative(page), len(out) + 1, line, code, m["reason"] if m else None))
    return out


def needed_modules(code: str) -> list[str]:
    """The optional modules a block imports (or calls into), in the order it names them."""
    if code.lstrip().startswith(">>>"):
        code = "".join(example.source for example in doctest.DocTestParser().get_examples(code))
    try:
        tree = ast.parse(code)
    except SyntaxError:  # reported when the block runs
        return []
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name.split(".")[0] for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.append(node.module.split(".")[0])
        elif isinstance(node, ast.Attribute) and node.attr in NEEDS_MODULE:
            names.append(NEEDS_MODULE[node.attr])
    return [name for name in dict.fromkeys(names) if name in EXTRAS]


def missing_extra(block: Block) -> str | None:
    for module in needed_modules(block.code):
        if importlib.util.find_spec(module) is None:
            return f"needs {module} (the `{EXTRAS[module]}` extra), not installed"
    return None


def plan(page: Path) -> list[tuple[Block, str | None]]:
    """Each python block of the page with the reason it does not run here (None: it runs)."""
    out, after = [], None
    for block in python_blocks(page):
        reason = block.marker
        if reason is None and after is not None:
            reason = f"follows a block that {after}"
        if reason is None:
            missing = missing_extra(block)
            if missing is not None:
                reason = after = missing
        out.append((block, reason))
    return out


PLANS = {relative(page): plan(page) for page in PAGES}
RUN_PAGES = [page for page, blocks in PLANS.items() if any(reason is None for _, reason in blocks)]
NOT_RUN_BLOCKS = [(block, reason) for blocks in PLANS.values() for block, reason in blocks if reason is not None]


def test_markers_name_known_reasons_before_python_blocks():
    for page in PAGES:  # a marker names a known reason, right before a python block
        lines = page.read_text().splitlines()
        for n, line in enumerate(lines):
            if "<!-- snippet" not in line:
                continue
            where = f"{relative(page)}:{n + 1}"
            marker = MARKER.match(line)
            assert marker and marker["reason"].startswith(REASONS), f"{where}: unknown marker {line!r}"
            fence = FENCE.match(lines[n + 1]) if n + 1 < len(lines) else None
            assert fence and fence["lang"] == "python", f"{where}: the marker is not before a python block"


def run_transcript(block: Block, namespace: dict) -> None:
    test = doctest.DocTestParser().get_doctest(block.code, namespace, block.label, block.page, block.line)
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    failures = []
    runner.run(test, out=failures.append, clear_globs=False)
    assert runner.failures == 0, "".join(failures)


@pytest.mark.parametrize("page", RUN_PAGES)
def test_snippets_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(ROOT))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    namespace = {"__name__": "__docs__"}
    for block, reason in PLANS[page]:
        if reason is not None:
            continue
        if block.code.lstrip().startswith(">>>"):
            run_transcript(block, namespace)
            continue
        # the block's text where a file's would be, for the spec tracer (it names values after
        # the spec's variables, as for a spec in a file) and for tracebacks
        filename = f"<{block.label}>"
        monkeypatch.setitem(linecache.cache, filename, (len(block.code), None, block.code.splitlines(True), filename))
        code = compile(block.code, filename, "exec")
        try:
            exec(code, namespace)
        except Exception as exc:
            raise AssertionError(
                f"{block.label} raised {exc!r} (a block that cannot run here is marked on the line before it:"
                " <!-- snippet: not run (REASON) -->)"
            ) from exc


@pytest.mark.parametrize(
    "block, reason", NOT_RUN_BLOCKS, ids=[f"{block.page}:{block.number}" for block, _ in NOT_RUN_BLOCKS]
)
def test_snippet_not_run(block, reason):
    pytest.skip(f"{block.label}: {reason}")


# Links

LINK = re.compile(r"\[(?P<text>[^\]]*)\]\((?P<target>[^)\s]+)\)")
CODE_SPAN = re.compile(r"(`+)(?!`).*?(?<!`)\1(?!`)")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(?P<text>.*?)\s*#*\s*$")


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: its text lowercased, punctuation but '-' and '_' dropped,
    spaces to '-'."""
    text = LINK.sub(lambda m: m["text"], heading)
    text = re.sub(r"<[^>]+>", "", text).lower()
    text = "".join(ch for ch in text if ch.isalnum() or ch in "-_ ")
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    _, prose = split_fences(page.read_text())
    seen: dict[str, int] = {}
    out = set()
    for line in prose:
        m = HEADING.match(line)
        if not m:
            continue
        base = anchor(m["text"])
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.add(base if count == 0 else f"{base}-{count}")  # GitHub numbers repeated headings
    return out


def links(page: Path) -> list[tuple[int, str]]:
    _, prose = split_fences(page.read_text())
    out = []
    for n, line in enumerate(prose, 1):
        for m in LINK.finditer(CODE_SPAN.sub("code", line)):
            out.append((n, m["target"]))
    return out


def test_relative_links_resolve():
    broken, checked = [], 0
    for page in PAGES:
        for line, target in links(page):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: are not fetched
                continue
            checked += 1
            path, _, fragment = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            where = f"{relative(page)}:{line}: {target}"
            if not file.exists():
                broken.append(f"{where}: no such file")
            elif fragment and file.suffix == ".md" and fragment not in anchors(file):
                broken.append(f"{where}: no heading #{fragment} in {relative(file)}")
    assert checked > 50
    assert not broken, "\n".join(broken)
