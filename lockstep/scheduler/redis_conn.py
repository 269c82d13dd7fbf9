"""The scheduler's Redis connection: how it rides out a Redis restart and a burst of requests.

A Redis restart (the supervisor restarts a crashed embedded server on the same port; it replays
its append-only file in well under a second for this state) must look like a slow command, not
an error: every command retries connection errors with jittered exponential backoff for about
25 seconds before giving up. A transaction under WATCH is not retried blindly (redis-py
raises instead, and the store's WATCH loops start over). Many concurrent long-polls and submits
wait for a free connection rather than failing with "Too many connections".
"""

from __future__ import annotations

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

MAX_CONNECTIONS = 256
POOL_WAIT_S = 30.0  # wait this long for a free connection before failing
RETRIES = 30  # jittered backoff, 0.05 s doubling to a 2 s cap: about 25 s in all
BACKOFF_BASE_S = 0.05
BACKOFF_CAP_S = 2.0

# What a client of the store may treat as "Redis is away for now": answer try_again / 503, never
# a permanent error.
UNAVAILABLE_ERRORS = (RedisConnectionError, RedisTimeoutError)


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
    return aioredis.Redis(connection_pool=pool)
