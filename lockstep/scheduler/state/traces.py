"""Session traces in Redis: a bounded list of Chrome-trace events per session that expires
some time after its last write (what an event holds is `observers/tracing.py`'s). Events are
written by `batch.WriteBatch.trace`, beside the other writes of their cycle or sampling batch."""

from __future__ import annotations

from typing import Any

from lockstep.scheduler.state import keys


class TraceLog:
    def __init__(self, redis: Any) -> None:
        self.redis = redis

    async def read(self, session_id: str) -> list[bytes]:
        return list(await self.redis.lrange(keys.session_trace(session_id), 0, -1))
