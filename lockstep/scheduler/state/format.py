"""The state's format, stamped in Redis and in the data directory, and what a starting Lockstep
does with the state it finds: serve it, migrate it (once, crash-safe), or refuse to start.

Lockstep's state is two halves that only make sense together: Redis (jobs, progress, replay logs,
the catalog; `keys.py`) and the data directory (snapshots under `state/`, checkpoints under
`checkpoints/`). Each half carries a stamp: `ls:format` in Redis and `<data>/STATE_FORMAT` on
disk, both `{"format": N, "written_by": "<Lockstep version>"}`. N is `version.STATE_FORMAT` of
the release that wrote (or last migrated) the state; a release that changes what it writes or
how it reads it moves N and adds a `migrations.Migration` from the previous N.

Before anything reads the state (the scheduler at start, and `lockstep serve` before it starts
the scheduler), `inspect_state` decides, reading only:

- no stamp and no state on either side: a new deployment (both are stamped);
- the running format on both sides: serve it;
- an older format this release migrates from: migrate it. Each migration step does the Redis
  half, stamps Redis, does the data-directory half, stamps the directory; every half is
  idempotent, so a crash anywhere leaves Redis at most one step ahead of the directory and the
  next start resumes where it stopped (never a state read half-migrated);
- anything else is refused before a byte is written, naming both versions and what to do: a
  newer format (written by a later Lockstep), one older than the migrations reach, state with no
  stamp (written before the first stamped release), or halves that do not belong together.

`lockstep serve` and the scheduler refuse with the same `StateRefused` message; like
`pg_upgrade --check`, `inspect_state` alone changes nothing.
"""

from __future__ import annotations

import json
import logging
import os
import urllib.parse
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from lockstep.scheduler.state import keys
from lockstep.scheduler.state.migrations import MIGRATIONS, OLDEST_MIGRATED
from lockstep.version import STATE_FORMAT, VERSION

log = logging.getLogger(__name__)

STAMP_FILE = "STATE_FORMAT"
# The exit status of a process that refused the state (`lockstep serve`, the scheduler).
STATE_REFUSED_EXIT = 3
# What in the data directory is state (the rest is runtime files, built models, Redis's own
# files when it is embedded, which its stamp covers).
STATE_DIRS = ("state", "checkpoints")


class StateRefused(Exception):
    """This Lockstep will not serve the state it found (the message says why and what to do)."""


@dataclass(frozen=True)
class Stamp:
    format: int
    written_by: str  # the Lockstep version that wrote (or last migrated) the state

    def encode(self) -> bytes:
        return json.dumps({"format": self.format, "written_by": self.written_by}).encode()

    @classmethod
    def decode(cls, raw: bytes, where: str) -> Stamp:
        try:
            data = json.loads(raw)
            return cls(int(data["format"]), str(data["written_by"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise StateRefused(
                f"{where} holds an unreadable state format stamp ({raw[:80]!r}): {exc}. It was "
                "not written by Lockstep; restore it from a backup, or start with an empty "
                "Redis and data directory."
            ) from exc

    def describe(self) -> str:
        return f"state format {self.format}, written by Lockstep {self.written_by}"


RUNNING = Stamp(STATE_FORMAT, VERSION)


class Action(StrEnum):
    NEW = "new"  # nothing there yet: stamp both halves
    SERVE = "serve"  # the running format (a missing stamp of an empty half is written)
    MIGRATE = "migrate"  # an older format this release migrates


@dataclass(frozen=True)
class Found:
    """What a start found: each half's stamp (None: none) and whether it holds any state."""

    redis: Stamp | None
    directory: Stamp | None
    redis_has_state: bool
    directory_has_state: bool


@dataclass(frozen=True)
class Verdict:
    action: Action
    found: Found
    where: tuple[str, str]  # how to name Redis and the data directory in messages

    @property
    def format(self) -> int:
        """The format the state is in (the older half's while a migration is under way)."""
        stamps = [s.format for s in (self.found.redis, self.found.directory) if s is not None]
        return min(stamps, default=STATE_FORMAT)

    def describe(self) -> str:
        if self.action == Action.NEW:
            return f"new state: stamped {RUNNING.describe()}"
        if self.action == Action.SERVE:
            return f"serving {RUNNING.describe()}"
        return f"migrating state format {self.format} to {STATE_FORMAT} (Lockstep {VERSION})"


def redis_label(url: str) -> str:
    """How messages name a Redis: its URL without credentials."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return f"Redis at {urllib.parse.urlunsplit(parts._replace(netloc=netloc))}"


# ---------------------------------------------------------------- reading (changes nothing)
async def read_redis(redis: Any) -> tuple[Stamp | None, bool]:
    """Redis's stamp, and whether it holds any other Lockstep key."""
    raw = await redis.get(keys.FORMAT)
    stamp = None if raw is None else Stamp.decode(raw, f"Redis key {keys.FORMAT}")
    cursor: int = 0
    while True:
        cursor, found = await redis.scan(cursor, match=keys.PREFIX + "*", count=1000)
        if any(k != keys.FORMAT.encode() for k in found):
            return stamp, True
        if cursor == 0:
            return stamp, False


def read_directory(data_dir: Path) -> tuple[Stamp | None, bool]:
    """The data directory's stamp, and whether it holds any state."""
    path = data_dir / STAMP_FILE
    stamp = Stamp.decode(path.read_bytes(), str(path)) if path.is_file() else None
    has_state = any(
        (data_dir / name).is_dir() and any((data_dir / name).iterdir()) for name in STATE_DIRS
    )
    return stamp, has_state


async def inspect_state(redis: Any, data_dir: Path, redis_name: str = "Redis") -> Verdict:
    """What starting on this state would do; raises StateRefused. Writes nothing."""
    r, r_state = await read_redis(redis)
    d, d_state = read_directory(data_dir)
    found = Found(r, d, r_state, d_state)
    where = (redis_name, f"the data directory {data_dir}")
    return Verdict(_decide(found, where), found, where)


RUNNING_TEXT = f"this is Lockstep {VERSION}, which reads state formats up to {STATE_FORMAT}"
UNCHANGED = "Nothing was changed."
TOGETHER = (
    "Start with the Redis and the data directory that were used together (--redis-url, --data-dir)."
)


def _decide(f: Found, where: tuple[str, str]) -> Action:
    redis_name, dir_name = where
    for name, stamp in ((redis_name, f.redis), (dir_name, f.directory)):
        if stamp is not None and stamp.format > STATE_FORMAT:
            raise StateRefused(
                f"{name} holds {stamp.describe()}; {RUNNING_TEXT}. {UNCHANGED} "
                f"Run Lockstep {stamp.written_by} or newer on this state (a release never reads "
                "a later release's state), or restore the Redis and data directory backed up "
                "before the upgrade."
            )
    if f.redis is None and f.directory is None:
        if not (f.redis_has_state or f.directory_has_state):
            return Action.NEW
        holder = redis_name if f.redis_has_state else dir_name
        raise StateRefused(
            f"{holder} holds Lockstep state without a format stamp: it was written by a "
            "Lockstep older than 0.2.0 (the first release that stamps its state), and Lockstep "
            f"{VERSION} cannot tell its layout. {UNCHANGED} Finish its runs with the "
            "Lockstep that wrote it, then start this one with a new data directory and an "
            "empty Redis."
        )
    if f.redis is None or f.directory is None:
        return _one_stamped(f, where)
    if f.redis.format not in (f.directory.format, f.directory.format + 1):
        raise StateRefused(
            f"{redis_name} holds {f.redis.describe()} but {dir_name} holds "
            f"{f.directory.describe()}: the two halves of the state do not belong together. "
            f"{UNCHANGED} {TOGETHER}"
        )
    # Redis one step ahead: a migration stopped between its two halves; it resumes.
    return _by_format(f.directory)


def _one_stamped(f: Found, where: tuple[str, str]) -> Action:
    """One half stamped, the other not: fine only while neither holds any state (a start that
    stopped between writing the two stamps)."""
    redis_name, dir_name = where
    if f.redis is None:
        stamped, stamp, other, other_has = dir_name, f.directory, redis_name, f.redis_has_state
    else:
        stamped, stamp, other, other_has = redis_name, f.redis, dir_name, f.directory_has_state
    assert stamp is not None
    if f.redis_has_state or f.directory_has_state:
        raise StateRefused(
            f"{stamped} holds {stamp.describe()}, but {other} has no stamp "
            f"({'and unstamped state' if other_has else 'and no state'}): the two halves of "
            f"the state do not belong together. {UNCHANGED} {TOGETHER}"
        )
    return _by_format(stamp)


def _by_format(stamp: Stamp) -> Action:
    if stamp.format == STATE_FORMAT:
        return Action.SERVE
    if stamp.format < OLDEST_MIGRATED:
        raise StateRefused(
            f"the state is {stamp.describe()}; this is Lockstep {VERSION}, which migrates state "
            f"from format {OLDEST_MIGRATED} on. {UNCHANGED} Upgrade through the releases in "
            "between first (CHANGELOG.md names each release's state format)."
        )
    return Action.MIGRATE


# ---------------------------------------------------------------- writing
async def prepare_state(redis: Any, data_dir: Path, redis_name: str = "Redis") -> Verdict:
    """Make the state the running format: stamp a new deployment, migrate an older format, or
    raise StateRefused (having written nothing). Returns what was found and done."""
    verdict = await inspect_state(redis, data_dir, redis_name)
    found = verdict.found
    # Where each half stands; an unstamped half holds nothing, so it starts where the other is.
    redis_at = verdict.format if found.redis is None else found.redis.format
    dir_at = verdict.format if found.directory is None else found.directory.format
    if verdict.action != Action.SERVE:
        log.info("%s", verdict.describe())
    for step in MIGRATIONS:
        if redis_at < step.to:
            log.info("migrating Redis to state format %d: %s", step.to, step.what)
            await step.redis(redis, data_dir)
            await write_redis(redis, Stamp(step.to, VERSION))
            redis_at = step.to
        if dir_at < step.to:
            log.info("migrating the data directory to state format %d: %s", step.to, step.what)
            step.directory(data_dir)
            write_directory(data_dir, Stamp(step.to, VERSION))
            dir_at = step.to
    if found.redis is None and verdict.action != Action.MIGRATE:
        await write_redis(redis, RUNNING)
    if found.directory is None and verdict.action != Action.MIGRATE:
        write_directory(data_dir, RUNNING)
    return verdict


async def write_redis(redis: Any, stamp: Stamp) -> None:
    await redis.set(keys.FORMAT, stamp.encode())


def write_directory(data_dir: Path, stamp: Stamp) -> None:
    """Write the stamp whole or not at all (a temporary file, fsynced, renamed, the directory
    fsynced), so a crash never leaves a torn stamp."""
    data_dir.mkdir(parents=True, exist_ok=True)
    path = data_dir / STAMP_FILE
    tmp = path.with_name(f".{STAMP_FILE}.partial")
    with open(tmp, "wb") as f:
        f.write(stamp.encode() + b"\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(data_dir, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
