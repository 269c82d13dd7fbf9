"""One batch of writes (scheduler/state/batch.py) on a real Redis: a cycle's usage, audit and
trace writes (or a sampling batch's answers beside them) go in one round trip; a refused trace
write is logged and the rest stand; a refused write of any other kind raises once everything
beside it was written."""

from __future__ import annotations

import asyncio
import json

import pytest

from lockstep.observability import metrics
from lockstep.scheduler.state import keys
from lockstep.scheduler.state.store import Store

OWNER = "owner-1"
HOUR = 480_000


def _round_trips() -> float:
    value = metrics.SCHEDULER.get_sample_value(
        "lockstep_redis_round_trips_total", {"caller": metrics.RedisCaller.OTHER}
    )
    return value or 0.0


def test_usage_audit_and_trace_go_in_one_round_trip(clean_redis: str) -> None:
    async def go() -> None:
        store = Store.from_url(clean_redis)
        await store.ping()  # the connection is open: only the batch is counted below
        before = _round_trips()
        async with store.batch() as batch:
            batch.usage(OWNER, HOUR, {"s|m|steps": 1, "s|m|tokens_trained": 40}, 60)
            batch.audit(OWNER, "checkpoint_created", json.dumps({"a": 1}), 60)
            batch.trace({"s": [json.dumps({"name": "cycle 1"})]}, keep_events=10, retention_s=60)
        assert _round_trips() - before == 1
        assert await store.ledger.usage(OWNER, range(HOUR, HOUR + 1)) == [
            {"s|m|steps": 1, "s|m|tokens_trained": 40}
        ]
        assert len(await store.ledger.audit_entries(OWNER, 0, 2**62)) == 1
        assert len(await store.traces.read("s")) == 1
        before = _round_trips()
        async with store.batch():  # nothing queued: nothing sent
            pass
        assert _round_trips() == before
        await store.close()

    asyncio.run(go())


def test_a_refused_trace_is_logged_and_the_usage_beside_it_stands(
    clean_redis: str, caplog: pytest.LogCaptureFixture
) -> None:
    async def go() -> None:
        store = Store.from_url(clean_redis)
        await store.redis.set(keys.session_trace("s"), "not a list")  # RPUSH is refused
        async with store.batch() as batch:
            batch.trace({"s": ["{}"]}, keep_events=10, retention_s=60)
            batch.usage(OWNER, HOUR, {"s|m|steps": 1}, 60)
        assert await store.ledger.usage(OWNER, range(HOUR, HOUR + 1)) == [{"s|m|steps": 1}]
        await store.close()

    asyncio.run(go())
    assert "could not record the session trace" in caplog.text


def test_a_refused_usage_write_raises_after_the_rest_was_written(clean_redis: str) -> None:
    async def go() -> None:
        store = Store.from_url(clean_redis)
        await store.redis.set(keys.usage(OWNER, HOUR), "not a hash")  # HINCRBYFLOAT is refused
        with pytest.raises(Exception, match="WRONGTYPE"):
            async with store.batch() as batch:
                batch.usage(OWNER, HOUR, {"s|m|steps": 1}, 60)
                batch.trace({"s": ["{}"]}, keep_events=10, retention_s=60)
        assert await store.traces.read("s") == [b"{}"]
        await store.close()

    asyncio.run(go())
