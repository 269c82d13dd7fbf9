"""CHANGELOG.md's releases, newest first: `## <version>` headings, each followed by the lines
`Commit: <sha>` (the commit it was cut from; anything else while that commit does not exist
yet) and `State format: <N>`."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHANGELOG = ROOT / "CHANGELOG.md"
_HEADING = re.compile(r"^## (\d+\.\d+\.\d+\S*)\s*$")
_COMMIT = re.compile(r"^Commit: ([0-9a-f]{40})\s*$")
_FORMAT = re.compile(r"^State format: (\d+)\s*$")


@dataclass(frozen=True)
class Release:
    version: str
    commit: str | None  # None: not named yet
    state_format: int


def releases(path: Path = CHANGELOG) -> list[Release]:
    out: list[Release] = []
    version: str | None = None
    commit: str | None = None
    for line in path.read_text().splitlines():
        if m := _HEADING.match(line):
            version, commit = m.group(1), None
        elif version is not None and (m := _COMMIT.match(line)):
            commit = m.group(1)
        elif version is not None and (m := _FORMAT.match(line)):
            out.append(Release(version, commit, int(m.group(1))))
            version = None
    return out


def previous_release() -> Release | None:
    """The newest release whose commit is named: what the current code upgrades from."""
    return next((r for r in releases() if r.commit is not None), None)
