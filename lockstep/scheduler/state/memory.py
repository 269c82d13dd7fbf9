"""Redis's memory: read every second, and new work refused before Redis is full.

Redis runs with a memory limit and `maxmemory-policy noeviction` (the embedded one from
`--redis-maxmemory`; an external one as its operator sets it): at the limit it refuses writes
rather than drop a key, and each state script is refused whole then (`scripts.py`). So nothing
accepted is ever lost, but work accepted at the limit could not finish. The scheduler therefore
stops accepting new work at `REFUSE_AT` of the limit, while the work already accepted finishes
in the room left (its results, logs and traces), and takes new work again once results expire
or the limit is raised: a submission meanwhile is a 429 with Retry-After, which the SDK retries
(the transient answer; nothing about the request is wrong).

A Redis that may evict keys (any other policy) could drop a pending future or a run's progress:
the scheduler refuses to start on one (`check_policy`).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from lockstep.observability import metrics

log = logging.getLogger(__name__)

REFUSE_AT = 0.9  # of maxmemory: the rest is room for the work already accepted to finish
NO_EVICTION = "noeviction"
PERIOD_S = 1.0


class RedisFull(Exception):
    """Redis is too full for new work right now (a 429: retry later)."""


class EvictingRedis(Exception):
    """Redis may evict Lockstep's keys (its maxmemory-policy is not noeviction)."""


@dataclass(frozen=True)
class RedisMemory:
    used: int
    limit: int  # 0: none
    policy: str

    @property
    def full(self) -> bool:
        return self.limit > 0 and self.used >= REFUSE_AT * self.limit

    def describe(self) -> str:
        if not self.limit:
            return f"{self.used / 2**20:.0f} MiB used (no limit)"
        share = self.used / self.limit
        return f"{self.used / 2**20:.0f} of {self.limit / 2**20:.0f} MiB ({share:.0%})"


class MemoryWatch:
    """The scheduler's view of Redis's memory, and the admission rule that follows from it."""

    def __init__(self, redis: Any) -> None:
        self.redis = redis
        self.latest = RedisMemory(0, 0, NO_EVICTION)

    async def read(self) -> RedisMemory:
        info = await self.redis.info("memory")
        self.latest = RedisMemory(
            int(info.get("used_memory", 0)),
            int(info.get("maxmemory", 0)),
            str(info.get("maxmemory_policy", NO_EVICTION)),
        )
        metrics.REDIS_USED_MEMORY.set(self.latest.used)
        metrics.REDIS_MAX_MEMORY.set(self.latest.limit)
        metrics.ADMISSION_PAUSED.labels("redis_memory").set(int(self.latest.full))
        return self.latest

    async def check_policy(self, redis_name: str) -> RedisMemory:
        """The memory now; EvictingRedis if Redis may evict keys."""
        now = await self.read()
        if now.limit and now.policy != NO_EVICTION:
            raise EvictingRedis(
                f"{redis_name} runs with maxmemory-policy {now.policy}: at its limit it would "
                "evict keys, and an evicted job or progress record is a lost step or a future "
                f"that never completes. Set maxmemory-policy {NO_EVICTION} (a full Redis then "
                "refuses writes, and Lockstep refuses new work before it is full)."
            )
        return now

    def admit(self) -> None:
        """Raise RedisFull while Redis is too full for new work."""
        if self.latest.full:
            raise RedisFull(
                f"Redis holds {self.latest.describe()} of its memory limit: new work is "
                "refused until finished results expire or the operator raises the limit "
                "(--redis-maxmemory); retry later"
            )

    async def run(self) -> None:
        """Read the memory every second until cancelled; log when admission pauses or
        resumes."""
        while True:
            was = self.latest.full
            try:
                now = await self.read()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the PING probe reports an unreachable Redis
                log.debug("redis memory read failed: %s", exc)
            else:
                if now.full != was:
                    log.warning(
                        "Redis memory %s: %s",
                        now.describe(),
                        "refusing new work" if now.full else "accepting new work again",
                    )
            await asyncio.sleep(PERIOD_S)
