"""Migrations of the state from one format to the next (`format.py` runs them, in order, once).

Each step turns format `to - 1` into `to`: its Redis half, then its data-directory half, each
idempotent (a crash re-runs the half it was in; running a half twice changes nothing more), and
each half's stamp is written right after it. A release that changes what it writes or how it
reads it moves `version.STATE_FORMAT` and appends its step here, and says so in CHANGELOG.md.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lockstep.version import STATE_FORMAT


@dataclass(frozen=True)
class Migration:
    to: int  # the format it produces, from `to - 1`
    what: str  # one line for the log
    redis: Callable[[Any, Path], Awaitable[None]]  # (async Redis client, data dir)
    directory: Callable[[Path], None]


# Format 1 is the first stamped one (Lockstep 0.2.0): nothing before it is migrated.
MIGRATIONS: tuple[Migration, ...] = ()
OLDEST_MIGRATED = STATE_FORMAT - len(MIGRATIONS)
