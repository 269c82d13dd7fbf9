"""Training runs and sampling sessions: their records (a run's with its session's in one round
trip), each owner's index of runs, and the owners the clock's per-key quota reads."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec

from lockstep.scheduler.state import keys
from lockstep.scheduler.state.records import (
    HistoryEntry,
    ModelRecord,
    SamplerRecord,
    SessionRecord,
    decode,
    encoder,
)
from lockstep.scheduler.state.scripts import READS

R = TypeVar("R")


@dataclass(frozen=True)
class RunStats:
    last_request_time: float | None
    steps: int  # optim_steps committed
    tokens_trained: int  # forward_backward tokens committed
    queued: int  # training requests queued
    session_ended: bool


# A model's or sampler's record and its session's (the session id is in the record).
_WITH_SESSION = (
    READS
    + """
local model = redis.call('GET', KEYS[1])
if not model then return {false, false} end
return {model, redis.call('GET', ARGV[1] .. cjson.decode(model)['session_id'])}
"""
)


async def _with_session(
    redis: Any, key: str, kind: type[R]
) -> tuple[R | None, SessionRecord | None]:
    rec, session = await redis.eval(_WITH_SESSION, 1, key, keys.session(""))
    return (
        None if rec is None else decode(rec, kind),
        None if session is None else decode(session, SessionRecord),
    )


class Runs:
    def __init__(self, redis: Any) -> None:
        self.redis = redis

    async def put(self, rec: ModelRecord) -> None:
        await self.redis.set(keys.model(rec.model_id), encoder.encode(rec))

    async def get(self, model_id: str) -> ModelRecord | None:
        raw = await self.redis.get(keys.model(model_id))
        return None if raw is None else decode(raw, ModelRecord)

    async def with_session(self, model_id: str) -> tuple[ModelRecord | None, SessionRecord | None]:
        """A run's record and its session's, in one round trip."""
        return await _with_session(self.redis, keys.model(model_id), ModelRecord)

    async def of_owner(self, owner: str, offset: int, limit: int) -> tuple[list[str], int]:
        """A page of the owner's run ids, newest first, and how many there are."""
        key = keys.owner_runs(owner)
        ids = await self.redis.zrevrange(key, offset, offset + max(limit, 1) - 1)
        return [i.decode() for i in ids], int(await self.redis.zcard(key))

    async def all_of_owner(self, owner: str) -> list[str]:
        return [i.decode() for i in await self.redis.zrevrange(keys.owner_runs(owner), 0, -1)]

    async def owners(self, model_ids: list[str]) -> dict[str, str]:
        """The API key (owner) of each run that still exists (the per-key cycle quota)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for model_id in model_ids:
                pipe.get(keys.model(model_id))
            raw = await pipe.execute()
        return {
            m: decode(r, ModelRecord).owner
            for m, r in zip(model_ids, raw, strict=True)
            if r is not None
        }

    async def last_request_time(self, model_id: str) -> float | None:
        raw = await self.redis.hget(keys.progress(model_id), "last_request_time")
        return None if raw is None else float(raw)

    async def every(self, offset: int, limit: int) -> tuple[list[ModelRecord], int]:
        """A page of every owner's runs, newest first, and how many there are (admin keys)."""
        ids = sorted(m.decode() for m in await self.redis.smembers(keys.ALL_MODELS))
        async with self.redis.pipeline(transaction=False) as pipe:
            for model_id in ids:
                pipe.get(keys.model(model_id))
            raw = await pipe.execute()
        recs = [decode(r, ModelRecord) for r in raw if r is not None]
        recs.sort(key=lambda r: (r.created, r.model_id), reverse=True)
        return recs[offset : offset + max(limit, 1)], len(recs)

    async def stats(self, model_id: str, session_id: str) -> RunStats:
        """What a run's listing shows beside its record, in one round trip."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hmget(keys.progress(model_id), "last_request_time", "steps", "tokens")
            pipe.zcard(keys.pending(model_id))
            pipe.get(keys.session(session_id))
            (last, steps, tokens), queued, session = await pipe.execute()
        return RunStats(
            last_request_time=None if last is None else float(last),
            steps=int(steps or 0),
            tokens_trained=int(tokens or 0),
            queued=int(queued),
            session_ended=session is None or decode(session, SessionRecord).finished,
        )

    async def history(self, model_id: str) -> tuple[list[HistoryEntry], int]:
        """The run's metrics history (oldest first) and the optim_steps committed, read together."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.lrange(keys.history(model_id), 0, -1)
            pipe.hget(keys.progress(model_id), "steps")
            raw, steps = await pipe.execute()
        entries = msgspec.json.decode(b"[" + b",".join(raw) + b"]", type=list[HistoryEntry])
        return entries, int(steps or 0)

    async def queued(
        self, model_id: str, limit: int
    ) -> tuple[list[tuple[str, int, list[Any]]], int]:
        """The run's first `limit` queued training requests (request id, seq_id, the job's kind
        and status) in seq_id order, and how many are queued."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.zrange(keys.pending(model_id), 0, limit - 1, withscores=True)
            pipe.zcard(keys.pending(model_id))
            page, total = await pipe.execute()
        async with self.redis.pipeline(transaction=False) as pipe:
            for rid, _ in page:
                pipe.hmget(keys.job(rid.decode()), "kind", "status")
            jobs = await pipe.execute()
        return [
            (rid.decode(), int(seq), fields) for (rid, seq), fields in zip(page, jobs, strict=True)
        ], int(total)


class Samplers:
    def __init__(self, redis: Any) -> None:
        self.redis = redis

    async def put(self, rec: SamplerRecord) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.set(keys.sampler(rec.sampler_id), encoder.encode(rec))
            pipe.sadd(keys.session_samplers(rec.session_id), rec.sampler_id)
            pipe.zadd(keys.SAMPLER_USES, {rec.sampler_id: rec.created})
            await pipe.execute()

    async def used(self, sampler_id: str) -> None:
        """The sampler was used now (a client joined it): its expiry starts again."""
        await self.redis.zadd(keys.SAMPLER_USES, {sampler_id: time.time()}, xx=True)

    async def unused_since(self, cutoff: float, limit: int) -> list[str]:
        """Samplers last used before `cutoff` (unix seconds), oldest first."""
        found = await self.redis.zrangebyscore(keys.SAMPLER_USES, "-inf", cutoff, 0, limit)
        return [s.decode() for s in found]

    async def remove(self, sampler_id: str, session_id: str | None) -> None:
        """Forget a sampling session: its record, its clients' counter and completion logs (a
        poll for it is then a 404). Deletions only: served while Redis is full."""
        clones = int(await self.redis.get(keys.sampler_clients(sampler_id)) or 0)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(keys.sampler(sampler_id), keys.sampler_clients(sampler_id))
            for clone in range(clones + 1):
                pipe.delete(
                    keys.sample_done(sampler_id, clone), keys.sample_done_cursor(sampler_id, clone)
                )
            if session_id is not None:
                pipe.srem(keys.session_samplers(session_id), sampler_id)
            pipe.zrem(keys.SAMPLER_USES, sampler_id)
            await pipe.execute()

    async def get(self, sampler_id: str) -> SamplerRecord | None:
        raw = await self.redis.get(keys.sampler(sampler_id))
        return None if raw is None else decode(raw, SamplerRecord)

    async def with_session(
        self, sampler_id: str
    ) -> tuple[SamplerRecord | None, SessionRecord | None]:
        """A sampler's record and its session's, in one round trip."""
        return await _with_session(self.redis, keys.sampler(sampler_id), SamplerRecord)
