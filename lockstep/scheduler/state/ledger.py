"""The accounting ledger in Redis: usage counters in a hash per (owner, UTC hour) and an
append-only audit stream per owner (XADD only, trimmed by age). What the counters and entries
mean is `observers/accounting.py`'s; this module only stores them."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

from lockstep.scheduler.state import keys


class LedgerBatch:
    """Writes queued on one pipeline: sent together, one round trip."""

    def __init__(self, pipe: Any) -> None:
        self.pipe = pipe

    def usage(self, owner: str, hour: int, amounts: Mapping[str, float], keep_s: int) -> None:
        """Add `amounts` to the owner's counters of `hour`; the hash expires `keep_s` later."""
        key = keys.usage(owner, hour)
        for name, amount in amounts.items():
            if amount:
                self.pipe.hincrbyfloat(key, name, amount)
        self.pipe.expire(key, keep_s)

    def audit(self, owner: str, event: str, details_json: str, keep_s: float) -> None:
        """Append an entry; entries older than `keep_s` go as the stream grows."""
        self.pipe.xadd(
            keys.audit(owner),
            {"event": event, "details": details_json},
            minid=str(int((time.time() - keep_s) * 1000)),
            approximate=True,
        )


class Ledger:
    def __init__(self, redis: Any) -> None:
        self.redis = redis

    @asynccontextmanager
    async def batch(self) -> AsyncIterator[LedgerBatch]:
        async with self.redis.pipeline(transaction=False) as pipe:
            yield LedgerBatch(pipe)
            await pipe.execute()

    async def usage(self, owner: str, hour: int) -> dict[str, float]:
        raw = await self.redis.hgetall(keys.usage(owner, hour))
        return {k.decode(): float(v) for k, v in raw.items()}

    async def audit_entries(
        self, owner: str, low_ms: int, high_ms: int
    ) -> list[tuple[float, str, str]]:
        """(unix time, event, details JSON) of the owner's entries in [low_ms, high_ms]."""
        out = []
        for entry_id, fields in await self.redis.xrange(keys.audit(owner), low_ms, high_ms):
            millis = int(entry_id.decode().split("-")[0])
            out.append((millis / 1000, fields[b"event"].decode(), fields[b"details"].decode()))
        return out
