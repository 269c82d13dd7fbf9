"""Session traces in Redis: a stream of Chrome-trace events per session, trimmed by age (the
trace retention) and by count, that expires the retention after its last write (what an event
holds is `observers/tracing.py`'s). Events are written by `batch.WriteBatch.trace`, beside the
other writes of their cycle or sampling batch."""

from __future__ import annotations

from typing import Any

from lockstep.scheduler.state import keys
from lockstep.scheduler.state.batch import TRACE_FIELD


class TraceLog:
    def __init__(self, redis: Any) -> None:
        self.redis = redis

    async def read(self, session_id: str) -> list[bytes]:
        entries = await self.redis.xrange(keys.session_trace(session_id))
        return [fields[TRACE_FIELD.encode()] for _, fields in entries]
