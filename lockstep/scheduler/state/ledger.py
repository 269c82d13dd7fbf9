"""The accounting ledger in Redis: usage counters in a hash per (owner, UTC hour) and an
append-only audit stream per owner (XADD only, trimmed by age). What the counters and entries
mean is `observers/accounting.py`'s; this module reads them back, and `batch.WriteBatch` writes
them (beside a cycle's other writes, one round trip)."""

from __future__ import annotations

from typing import Any

from lockstep.scheduler.state import keys


class Ledger:
    def __init__(self, redis: Any) -> None:
        self.redis = redis

    async def usage(self, owner: str, hours: range) -> list[dict[str, float]]:
        """The owner's counters of each hour (one round trip)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for hour in hours:
                pipe.hgetall(keys.usage(owner, hour))
            raw = await pipe.execute()
        return [{k.decode(): float(v) for k, v in h.items()} for h in raw]

    async def audit_entries(
        self, owner: str, low_ms: int, high_ms: int
    ) -> list[tuple[float, str, str]]:
        """(unix time, event, details JSON) of the owner's entries in [low_ms, high_ms]."""
        out = []
        for entry_id, fields in await self.redis.xrange(keys.audit(owner), low_ms, high_ms):
            millis = int(entry_id.decode().split("-")[0])
            out.append((millis / 1000, fields[b"event"].decode(), fields[b"details"].decode()))
        return out
