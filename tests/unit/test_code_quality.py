"""The code-quality gate CI runs with the tests: lint, format, types, import layering.

Each check runs the real tool on the whole tree with the configuration in pyproject.toml
(ruff: pycodestyle/pyflakes/isort/bugbear/pyupgrade and mccabe complexity <= 12; mypy with
warn_unused_ignores; import-linter: no import cycle between sibling modules or packages at any
depth, plus the layering contracts). A failure prints the tool's own report.
"""

from __future__ import annotations

import os
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
    # The incremental cache (.mypy_cache) makes re-runs fast; a cold run takes ~30 s.
    _run(sys.executable, "-m", "mypy", "lockstep", timeout=600)


def test_no_import_cycles_and_layering_kept() -> None:
    _run(_tool("lint-imports"), "--no-cache")
