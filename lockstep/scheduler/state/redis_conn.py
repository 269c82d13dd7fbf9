"""The scheduler's Redis connection: how it rides out a Redis restart and a burst of requests.

A Redis restart (the supervisor restarts a crashed embedded server on the same port; it replays
its append-only file in well under a second for this state) must look like a slow command, not
an error: every command retries connection errors with jittered exponential backoff for about
25 seconds before giving up. A transaction under WATCH is not retried blindly (redis-py
raises instead, and the store's WATCH loops start over). Many concurrent long-polls and submits
wait for a free connection rather than failing with "Too many connections".

Every exchange with Redis (one command, or one pipeline or transaction sent at once) is counted
in `lockstep_redis_round_trips_total`, with the time from sending it to reading its last reply,
labelled by what made it (`metrics.REDIS_CALLER`): the connection class counts its own sends.
"""

from __future__ import annotations

import time
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.connection import AbstractConnection
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from lockstep.observability import metrics

MAX_CONNECTIONS = 256
POOL_WAIT_S = 30.0  # wait this long for a free connection before failing
RETRIES = 30  # jittered backoff, 0.05 s doubling to a 2 s cap: about 25 s in all
BACKOFF_BASE_S = 0.05
BACKOFF_CAP_S = 2.0

# What a client of the store may treat as "Redis is away for now": answer try_again / 503, never
# a permanent error.
UNAVAILABLE_ERRORS = (RedisConnectionError, RedisTimeoutError)
# Any failed Redis command (unavailable, or refused: a wrong type, out of memory).
ERRORS = RedisError
# A write Redis refused at its memory limit (noeviction): transient, retry later.
OUT_OF_MEMORY = OutOfMemoryError


class _CountsRoundTrips(AbstractConnection):
    """One send = one round trip (a pipeline's commands go in one write); its seconds run from
    the send to each reply read, so a pipeline's last reply closes it."""

    _trip_caller = "other"
    _trip_mark = 0.0

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        self._trip_caller = metrics.REDIS_CALLER.get()
        self._trip_mark = time.perf_counter()
        metrics.REDIS_ROUND_TRIPS.labels(self._trip_caller).inc()
        await super().send_packed_command(command, check_health)

    async def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().read_response(*args, **kwargs)
        finally:
            now = time.perf_counter()
            seconds = now - self._trip_mark
            metrics.REDIS_ROUND_TRIP_SECONDS.labels(self._trip_caller).inc(seconds)
            self._trip_mark = now


def counting(connection_class: type[AbstractConnection]) -> type[AbstractConnection]:
    """`connection_class` (TCP, TLS or unix socket, as the URL chose) counting round trips."""
    return type(f"Counted{connection_class.__name__}", (_CountsRoundTrips, connection_class), {})


def connect(url: str) -> aioredis.Redis:
    pool = aioredis.BlockingConnectionPool.from_url(
        url,
        max_connections=MAX_CONNECTIONS,
        timeout=POOL_WAIT_S,
        decode_responses=False,
        retry=Retry(ExponentialWithJitterBackoff(BACKOFF_CAP_S, BACKOFF_BASE_S), RETRIES),
        retry_on_error=list(UNAVAILABLE_ERRORS),
        health_check_interval=10,  # notice a connection the restart dropped before using it
    )
    pool.connection_class = counting(pool.connection_class)
    return aioredis.Redis(connection_pool=pool)
