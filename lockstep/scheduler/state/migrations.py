"""Migrations of the state from one format to the next (`format.py` runs them, in order, once).

Each step turns format `to - 1` into `to`: its Redis half, then its data-directory half, each
idempotent (a crash re-runs the half it was in; running a half twice changes nothing more), and
each half's stamp is written right after it. A release that changes what it writes or how it
reads it moves `version.STATE_FORMAT` and appends its step here, and says so in CHANGELOG.md.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lockstep.scheduler.state import keys
from lockstep.scheduler.state.batch import TRACE_FIELD
from lockstep.version import STATE_FORMAT


@dataclass(frozen=True)
class Migration:
    to: int  # the format it produces, from `to - 1`
    what: str  # one line for the log
    redis: Callable[[Any, Path], Awaitable[None]]  # (async Redis client, data dir)
    directory: Callable[[Path], None]


SCAN_COUNT = 1000


async def _scan(redis: Any, match: str) -> AsyncIterator[list[bytes]]:
    cursor = 0
    while True:
        cursor, found = await redis.scan(cursor, match=match, count=SCAN_COUNT)
        if found:
            yield found
        if cursor == 0:
            return


async def _bounded_retention(redis: Any, data_dir: Path) -> None:
    """Format 2 bounds what grows per step. A seq_id claim expires with its request's result:
    a claim without an expiry whose job has one gets the job's; one whose job is gone goes (a
    retry of it is refused as expired, as format 2 does); one whose job keeps no expiry (still
    queued, or in its model's replay log) gets it when the job does. Every sampling session is
    given a last use (now), from which --sampler-expiry counts. Session traces become streams
    (trimmed by age as well as by count)."""
    del data_dir
    async for claims in _scan(redis, keys.seq_claim_prefix("*") + "*"):
        async with redis.pipeline(transaction=False) as pipe:
            for claim in claims:
                pipe.ttl(claim)
                pipe.get(claim)
            found = await pipe.execute()
        bare = [
            (claim, rid)
            for claim, ttl, rid in zip(claims, found[::2], found[1::2], strict=True)
            if ttl == -1 and rid is not None
        ]
        async with redis.pipeline(transaction=False) as pipe:
            for _, rid in bare:
                pipe.pttl(keys.job(rid.decode()))
            job_ttls = await pipe.execute()
        async with redis.pipeline(transaction=False) as pipe:
            for (claim, _), job_ttl in zip(bare, job_ttls, strict=True):
                if job_ttl == -2:
                    pipe.delete(claim)
                elif job_ttl > 0:
                    pipe.pexpire(claim, job_ttl)
            await pipe.execute()
    now = time.time()
    async for samplers in _scan(redis, keys.sampler("*")):
        ids = [k.decode().removeprefix(keys.sampler("")) for k in samplers]
        await redis.zadd(keys.SAMPLER_USES, dict.fromkeys(ids, now), nx=True)
    async for traces in _scan(redis, keys.session_trace("*")):
        for key in traces:
            await _trace_to_stream(redis, key)


async def _trace_to_stream(redis: Any, key: bytes) -> None:
    """A session trace list (format 1) as a stream (format 2: trimmed by age), in one
    transaction; a stream already (a migration resumed) is left as it is."""
    if await redis.type(key) != b"list":
        return
    events = await redis.lrange(key, 0, -1)
    ttl = await redis.pttl(key)
    async with redis.pipeline(transaction=True) as pipe:
        pipe.delete(key)
        for event in events:
            pipe.xadd(key, {TRACE_FIELD: event})
        if ttl > 0:
            pipe.pexpire(key, ttl)
        await pipe.execute()


async def _format_2(redis: Any, data_dir: Path) -> None:
    """Format 2's Redis half: bounded retention, then the index of owners (`keys.OWNERS`, read
    by admin keys), filled from the owners' session indexes that format 1 already kept."""
    await _bounded_retention(redis, data_dir)
    pattern = keys.owner_sessions("*")
    prefix, suffix = pattern.split("*")
    async for found in _scan(redis, pattern):
        owners = [k.decode().removeprefix(prefix).removesuffix(suffix) for k in found]
        await redis.sadd(keys.OWNERS, *owners)


def _nothing(data_dir: Path) -> None:
    """The data directory's layout did not change."""


# Format 1 is the first stamped one (Lockstep 0.2.0): nothing before it is migrated.
MIGRATIONS: tuple[Migration, ...] = (
    Migration(
        2,
        "seq_id claims expire with their results; sampling sessions get a last use; session "
        "traces become streams; an index of owners",
        _format_2,
        _nothing,
    ),
)
OLDEST_MIGRATED = STATE_FORMAT - len(MIGRATIONS)
