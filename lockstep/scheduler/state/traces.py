"""Session traces in Redis: a bounded list of Chrome-trace events per session that expires
some time after its last write (what an event holds is `observers/tracing.py`'s)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from lockstep.scheduler.state import keys


class TraceLog:
    def __init__(self, redis: Any) -> None:
        self.redis = redis

    async def append(
        self, per_session: Mapping[str, Sequence[str]], keep_events: int, retention_s: int
    ) -> None:
        """Append each session's events (JSON), keep its last `keep_events`: one round trip."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for session_id, events in per_session.items():
                key = keys.session_trace(session_id)
                pipe.rpush(key, *events)
                pipe.ltrim(key, -keep_events, -1)
                pipe.expire(key, retention_s)
            await pipe.execute()

    async def read(self, session_id: str) -> list[bytes]:
        return list(await self.redis.lrange(keys.session_trace(session_id), 0, -1))
