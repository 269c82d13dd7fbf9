"""Durable scheduler state in Redis, one role object per kind of state over one connection.

Only the scheduler process writes here, and only through these roles and the other modules of
this package (`sample_futures`, `custom_losses`): nothing else in the scheduler touches Redis.
Every key comes from `keys`; every record type from `records`.

    sessions     session records, each owner's index, heartbeats     (sessions.py)
    runs         training-run records, owners, last request times    (runs.py)
    samplers     sampling-session records                            (runs.py)
    checkpoints  checkpoint records, inflight sampling targets       (checkpoints.py)
    jobs         request hashes: claims, outcomes, finished futures  (jobs.py)
    cycles       queues, a cycle's begin and commit, progress, replay (cycles.py)
    ledger       usage counters and the audit stream                 (ledger.py)
    traces       session traces                                      (traces.py)
    memory       Redis's memory, and admission near its limit        (memory.py)

`batch()` queues writes of several roles (a cycle's usage and traces, a sampling batch's
answers) on one pipeline: one round trip (batch.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from lockstep.config.limits import DEFAULT_FUTURE_TTL_S
from lockstep.scheduler.state import redis_conn
from lockstep.scheduler.state.batch import WriteBatch
from lockstep.scheduler.state.checkpoints import Checkpoints
from lockstep.scheduler.state.cycles import Cycles
from lockstep.scheduler.state.format import Verdict, prepare_state
from lockstep.scheduler.state.jobs import Jobs
from lockstep.scheduler.state.ledger import Ledger
from lockstep.scheduler.state.memory import MemoryWatch
from lockstep.scheduler.state.runs import Runs, Samplers
from lockstep.scheduler.state.sessions import Sessions
from lockstep.scheduler.state.traces import TraceLog

# Completed futures stay retrievable this long (the SDK may re-poll after a transport error).
RESULT_TTL_SECONDS = DEFAULT_FUTURE_TTL_S


class Store:
    def __init__(self, client: aioredis.Redis, result_ttl_s: int = RESULT_TTL_SECONDS) -> None:
        # redis-py types every reply as a bytes|str|int union; with decode_responses=False it is
        # always bytes, so the client is used untyped here.
        self.redis: Any = client
        self.result_ttl_s = result_ttl_s  # Limits.future_ttl_s
        self.sessions = Sessions(client)
        self.runs = Runs(client)
        self.samplers = Samplers(client)
        self.checkpoints = Checkpoints(client)
        self.jobs = Jobs(client, result_ttl_s)
        self.cycles = Cycles(client, self.jobs)
        self.ledger = Ledger(client)
        self.traces = TraceLog(client)
        self.memory = MemoryWatch(client)

    @classmethod
    def from_url(cls, url: str, result_ttl_s: int = RESULT_TTL_SECONDS) -> Store:
        return cls(redis_conn.connect(url), result_ttl_s)

    @asynccontextmanager
    async def batch(self) -> AsyncIterator[WriteBatch]:
        """Writes of several roles queued inside, sent on exit in one round trip."""
        async with self.redis.pipeline(transaction=False) as pipe:
            batch = WriteBatch(pipe)
            yield batch
            await batch.send()

    async def prepare_state(self, data_dir: Path, redis_name: str) -> Verdict:
        """Serve, stamp or migrate the state before anything reads it; StateRefused, having
        written nothing, for state this release does not serve (format.py)."""
        return await prepare_state(self.redis, data_dir, redis_name)

    async def ping(self) -> bool:
        return bool(await self.redis.ping())

    async def close(self) -> None:
        await self.redis.aclose()
