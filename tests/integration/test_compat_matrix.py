"""docs/compatibility.md is what scripts/compat_matrix.py finds when it probes every SDK method
against a real server (regenerate it with `python scripts/compat_matrix.py`)."""

from __future__ import annotations

import difflib
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import Server

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]


def test_compatibility_doc_is_current(server: Server, tmp_path: Path) -> None:
    out = tmp_path / "compatibility.md"
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "compat_matrix.py"),
            "--base-url",
            server.base_url,
            "--output",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    generated = out.read_text()
    assert "no probe for this method" not in generated, "a new SDK method needs a probe"
    current = (REPO / "docs" / "compatibility.md").read_text()
    diff = "".join(
        difflib.unified_diff(
            current.splitlines(True),
            generated.splitlines(True),
            "docs/compatibility.md",
            "generated",
        )
    )
    assert not diff, f"docs/compatibility.md is out of date; run scripts/compat_matrix.py\n{diff}"
