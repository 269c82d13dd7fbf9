"""The version is declared once (pyproject.toml) and every place reports it; CHANGELOG.md lists
each release with the commit it was cut from and the state format it writes, and that commit
declares that version and that format."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib

import pytest

from lockstep.version import STATE_FORMAT, VERSION
from tests.changelog import ROOT, releases

DECLARED = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def test_the_installed_version_is_the_declared_one() -> None:
    assert VERSION == DECLARED, (
        f"the installed package says {VERSION}, pyproject.toml {DECLARED}: reinstall it "
        "(pip install -e .)"
    )


def test_lockstep_version() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "lockstep.cli", "--version"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.strip() == f"lockstep {DECLARED} (state format {STATE_FORMAT})"


def test_the_changelog_names_each_release() -> None:
    listed = releases()
    assert listed, "CHANGELOG.md lists no release"
    assert listed[0].version == DECLARED, (
        f"pyproject.toml says {DECLARED}, the newest CHANGELOG.md release {listed[0].version}: "
        "a release moves both"
    )
    assert len({r.version for r in listed}) == len(listed)
    formats = [r.state_format for r in listed]
    assert formats == sorted(formats, reverse=True) and formats[0] <= STATE_FORMAT
    # Only the newest release may wait for its commit to be named.
    assert all(r.commit is not None for r in listed[1:]), listed


@pytest.mark.skipif(
    shutil.which("git") is None or not (ROOT / ".git").exists(),
    reason="not a git checkout: the releases' commits are NOT checked",
)
def test_each_release_commit_declares_its_version_and_format() -> None:
    for release in releases():
        if release.commit is None:
            continue
        show = subprocess.run(
            ["git", "-C", str(ROOT), "show", f"{release.commit}:pyproject.toml"],
            capture_output=True,
            text=True,
        )
        assert show.returncode == 0, (
            f"release {release.version}: commit {release.commit} is not in this checkout "
            f"({show.stderr.strip()}); fetch it (git fetch --unshallow)"
        )
        declared = tomllib.loads(show.stdout)["project"]["version"]
        assert declared == release.version, (release, declared)
        code = subprocess.run(
            ["git", "-C", str(ROOT), "show", f"{release.commit}:lockstep/version.py"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        found = re.search(r"^STATE_FORMAT = (\d+)$", code, re.MULTILINE)
        assert found and int(found.group(1)) == release.state_format, release
