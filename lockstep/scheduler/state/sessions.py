"""Sessions: their records, each owner's index of them, and the heartbeat clock the expiry
scan reads (`keys.SESSION_BEATS`, a sorted set scored by the last heartbeat)."""

from __future__ import annotations

import time
from typing import Any

from lockstep.scheduler.state import keys
from lockstep.scheduler.state.records import SessionRecord, decode, encoder


class Sessions:
    def __init__(self, redis: Any) -> None:
        self.redis = redis

    async def put(self, rec: SessionRecord) -> None:
        await self.redis.set(keys.session(rec.session_id), encoder.encode(rec))

    async def create(self, rec: SessionRecord) -> None:
        """A new session's record and its place in its owner's index, atomically."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.set(keys.session(rec.session_id), encoder.encode(rec))
            pipe.zadd(keys.owner_sessions(rec.owner), {rec.session_id: rec.created})
            pipe.sadd(keys.OWNERS, rec.owner)
            await pipe.execute()

    async def get(self, session_id: str) -> SessionRecord | None:
        raw = await self.redis.get(keys.session(session_id))
        return None if raw is None else decode(raw, SessionRecord)

    async def of_owner(self, owner: str, offset: int, limit: int) -> tuple[list[str], int]:
        """A page of the owner's session ids, newest first, and how many there are."""
        key = keys.owner_sessions(owner)
        ids = await self.redis.zrevrange(key, offset, offset + max(limit, 1) - 1)
        return [i.decode() for i in ids], int(await self.redis.zcard(key))

    async def owners(self) -> list[str]:
        """Every owner that has created a session (`keys.OWNERS`)."""
        return sorted(o.decode() for o in await self.redis.smembers(keys.OWNERS))

    async def index_owners(self) -> None:
        """Fill `keys.OWNERS` from the owners' session indexes (a scan, once at start-up and by
        `lockstep admin`): a Redis written before the set existed has the indexes only."""
        pattern = keys.owner_sessions("*")
        prefix, suffix = pattern.split("*")
        found = [k.decode() async for k in self.redis.scan_iter(match=pattern)]
        owners = [k.removeprefix(prefix).removesuffix(suffix) for k in found]
        if owners:
            await self.redis.sadd(keys.OWNERS, *owners)

    async def members(self, session_id: str) -> tuple[list[str], list[str]]:
        """The training runs and the sampling sessions created in the session."""
        models = await self.redis.smembers(keys.session_models(session_id))
        samplers = await self.redis.smembers(keys.session_samplers(session_id))
        return sorted(m.decode() for m in models), sorted(s.decode() for s in samplers)

    # ---------------------------------------------------------------- heartbeats
    async def beat(self, session_id: str, at: float | None = None) -> None:
        """Record a heartbeat; `at` (the session's creation) starts its clock."""
        if at is not None:
            await self.redis.zadd(keys.SESSION_BEATS, {session_id: at})
        else:  # only a session whose clock runs (an ended one left the set)
            await self.redis.zadd(keys.SESSION_BEATS, {session_id: time.time()}, xx=True)

    async def stop_beats(self, session_id: str) -> None:
        await self.redis.zrem(keys.SESSION_BEATS, session_id)

    async def silent_since(self, cutoff: float) -> list[str]:
        """The sessions whose last heartbeat is at or before `cutoff`."""
        raw = await self.redis.zrangebyscore(keys.SESSION_BEATS, "-inf", cutoff)
        return [r.decode() for r in raw]
