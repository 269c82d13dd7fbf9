"""The code-quality gate CI runs with the tests: lint, format, types, import layering.

Each check runs the real tool on the whole tree with the configuration in pyproject.toml
(ruff: pycodestyle/pyflakes/isort/bugbear/pyupgrade and mccabe complexity <= 12; mypy strict
with warn_unused_ignores on lockstep/, benchmarks/ and scripts/; import-linter: no import cycle
between sibling modules or packages at any depth, plus the layering contracts). A failure prints
the tool's own report. Beside them: the import graph has no circle through any module or package
(lazy imports included), and `Any` stays under 6 lines per 1,000.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _tool(name: str) -> str:
    """The tool installed beside this interpreter (the venv's), else the one on PATH."""
    beside = Path(sys.executable).with_name(name)
    found = str(beside) if beside.exists() else shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed: pip install -e '.[test]'")
    return found


def _run(*argv: str, timeout: float = 300) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    if proc.returncode != 0:
        pytest.fail(
            f"`{' '.join(Path(argv[0]).name if i == 0 else a for i, a in enumerate(argv))}` "
            f"failed ({proc.returncode}):\n{proc.stdout[-8000:]}\n{proc.stderr[-4000:]}",
            pytrace=False,
        )


def test_ruff_check() -> None:
    _run(_tool("ruff"), "check", "--no-cache", ".")


def test_ruff_format() -> None:
    _run(_tool("ruff"), "format", "--check", "--no-cache", ".")


def test_mypy() -> None:
    # The product and the code people run beside it (the benchmarks, the build scripts); the
    # tests are not typed. The incremental cache (.mypy_cache) makes re-runs fast; a cold run
    # takes ~45 s.
    _run(sys.executable, "-m", "mypy", "lockstep", "benchmarks", "scripts", timeout=600)


def test_no_import_cycles_and_layering_kept() -> None:
    _run(_tool("lint-imports"), "--no-cache")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(name: str, path: Path, modules: set[str]) -> set[str]:
    """Every lockstep module `name` makes Python run, from every import statement in it (lazy
    ones in functions included, TYPE_CHECKING ones too): what it names, and the packages above
    what it names that are not its own (their `__init__` runs first). `from P import x` names P
    itself, so a module importing its own package's `__init__` that way counts."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    own = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
    named: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            named += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            named += [base, *(f"{base}.{alias.name}" for alias in node.names)]
    out: set[str] = set()
    for target in named:
        if target in modules:
            out.add(target)
            parts = target.split(".")
            out |= {".".join(parts[:i]) for i in range(1, len(parts))} - own
    out.discard(name)
    return out & modules


def test_the_import_graph_has_no_circle() -> None:
    """No circle through any module or package, lazy imports included: `import-linter` sees
    siblings only and reads `from lockstep.gateway import deps` as an import of `deps`, but
    Python runs `lockstep/gateway/__init__.py` for it, so a package `__init__` that imports the
    module back closes a circle (the generated protobuf stubs aside)."""
    paths = {
        _module_name(p): p
        for p in (REPO / "lockstep").rglob("*.py")
        if not _module_name(p).startswith(("lockstep.v1", "lockstep.wire"))
    }
    graph = {name: _imports(name, path, set(paths)) for name, path in paths.items()}
    circles = [c for c in _strongly_connected(graph) if len(c) > 1]
    assert not circles, "import circles:\n" + "\n".join(" <-> ".join(sorted(c)) for c in circles)


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components, iteratively (the tree is deep enough for recursion limits)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            child = next(edges, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                found.append(component)
    return found


ANY_PER_1000_LINES = 6.0


def test_any_stays_rare() -> None:
    """`Any` switches the type checker off where it appears: lines using it (its imports aside)
    stay under 6 per 1,000 lines of `lockstep/` (the generated protobuf stubs aside). Where a
    value's type is open, `object` (narrowed where used), a Protocol or a TypedDict says more."""
    used = re.compile(r"\bAny\b")
    imported = re.compile(r"\s*(from typing import|import typing)")
    lines = any_lines = 0
    worst: list[tuple[int, str]] = []
    for path in (REPO / "lockstep").rglob("*.py"):
        if _module_name(path).startswith(("lockstep.v1", "lockstep.wire")):
            continue
        text = path.read_text().splitlines()
        count = sum(1 for line in text if used.search(line) and not imported.match(line))
        lines += len(text)
        any_lines += count
        worst.append((count, str(path.relative_to(REPO))))
    rate = 1000 * any_lines / lines
    top = ", ".join(f"{p} {n}" for n, p in sorted(worst, reverse=True)[:8])
    assert rate < ANY_PER_1000_LINES, f"{any_lines} lines use Any ({rate:.2f} per 1,000): {top}"
