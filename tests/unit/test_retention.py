"""What grows per step is bounded (a real Redis): a seq_id claim expires with its request's
result, and a retry after that is refused clearly instead of queueing a request the clock has
passed; a snapshot of a step whose commit failed is never recorded; a full Redis refuses every
state script whole; sampling sessions unused past --sampler-expiry go, with their weights."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
import redis

from lockstep.config import TenancyConfig
from lockstep.scheduler.state import keys
from lockstep.scheduler.state.claims import SeqExpired, TrainingClaim
from lockstep.scheduler.state.outcome import Outcome
from lockstep.scheduler.state.records import QueuedOp, SamplerRecord
from lockstep.scheduler.state.store import Store
from lockstep.vocab import OpKind
from tests.unit.test_store import RESULT, model_record

MODEL = "sess-1:train:0"
TTL = 100
T = TypeVar("T")


def with_store(url: str, body: Callable[[Store], Awaitable[T]]) -> T:
    async def go() -> T:
        store = Store.from_url(url, result_ttl_s=TTL)
        try:
            return await body(store)
        finally:
            await store.close()

    return asyncio.run(go())


def claim(seq: int, payload: bytes = b"p") -> TrainingClaim:
    return TrainingClaim(
        owner="o", model_id=MODEL, seq_id=seq, kind=OpKind.OPTIM_STEP, payload=payload, tokens=0
    )


async def run_step(store: Store, seq: int, replayed: bool) -> str:
    """Claim step `seq` and commit it as the clock does."""
    rid, _ = await store.jobs.claim_training(claim(seq))
    op = QueuedOp(rid, MODEL, seq, OpKind.OPTIM_STEP, 0)
    assert await store.cycles.commit_one(op, Outcome(RESULT, replayed=replayed))
    return rid


def test_a_claim_expires_with_its_result_and_a_late_retry_is_refused(
    clean_redis: str,
) -> None:
    r = redis.Redis.from_url(clean_redis)

    async def body(store: Store) -> None:
        await store.runs.put(model_record(MODEL))
        # Not kept for replay: the result and the claim expire together, at once.
        rid = await run_step(store, 0, replayed=False)
        assert 0 < r.ttl(keys.seq_claim(MODEL, 0)) <= TTL
        assert 0 < r.ttl(keys.job(rid)) <= TTL
        # Kept for replay: neither expires until a snapshot holds the step.
        kept = await run_step(store, 1, replayed=True)
        assert r.ttl(keys.seq_claim(MODEL, 1)) == -1 and r.ttl(keys.job(kept)) == -1
        assert await store.cycles.mark_snapshot(MODEL, 1) == 1
        assert 0 < r.ttl(keys.seq_claim(MODEL, 1)) <= TTL
        assert 0 < r.ttl(keys.job(kept)) <= TTL
        # Within the retention a retry finds its first request.
        assert await store.jobs.claim_training(claim(1)) == (kept, False)
        # After it, the same seq_id is refused: it can never run again (the clock passed it).
        r.delete(keys.seq_claim(MODEL, 1), keys.job(kept))
        with pytest.raises(SeqExpired, match="seq_id 1 of model .* expired.*next seq_id \\(2\\)"):
            await store.jobs.claim_training(claim(1))
        queues, _ = await store.cycles.queued_ops()
        assert MODEL not in queues  # nothing was queued

    with_store(clean_redis, body)


def test_a_snapshot_of_an_unrecorded_step_is_not_recorded(clean_redis: str) -> None:
    """A cycle whose commit Redis refused ran its steps on the engine; the engine's snapshot of
    that state must not become the model's durable state (the step runs again on the recorded
    one)."""

    async def body(store: Store) -> None:
        await store.runs.put(model_record(MODEL))
        await run_step(store, 0, replayed=True)
        await store.jobs.claim_training(claim(1))  # queued, its commit never happened
        assert await store.cycles.mark_snapshot(MODEL, 1) == -1
        assert await store.cycles.progress(MODEL) == (1, None)
        assert await store.cycles.mark_snapshot(MODEL, 0) == 0

    with_store(clean_redis, body)


def test_a_full_redis_refuses_each_write_script_whole(clean_redis: str) -> None:
    """At its limit (noeviction) Redis refuses a claim and a commit entirely: nothing of either
    is written, and both go through once there is room."""
    r = redis.Redis.from_url(clean_redis)

    async def body(store: Store) -> None:
        await store.runs.put(model_record(MODEL))
        rid, _ = await store.jobs.claim_training(claim(0))
        before = {k: r.dump(k) for k in r.keys("*")}
        used = int(r.info("memory")["used_memory"])
        r.config_set("maxmemory-policy", "noeviction")
        r.config_set("maxmemory", str(used // 2))
        try:
            with pytest.raises(redis.exceptions.OutOfMemoryError):
                await store.jobs.claim_training(claim(1))
            op = QueuedOp(rid, MODEL, 0, OpKind.OPTIM_STEP, 0)
            with pytest.raises(redis.exceptions.OutOfMemoryError):
                await store.cycles.commit_one(op, Outcome(RESULT, replayed=False))
            assert {k: r.dump(k) for k in r.keys("*")} == before
            assert (await store.memory.read()).full
            queues, _ = await store.cycles.queued_ops()  # reads are served meanwhile
            assert [o.request_id for o in queues[MODEL]] == [rid]
        finally:
            r.config_set("maxmemory", "0")
        assert await store.cycles.commit_one(op, Outcome(RESULT, replayed=False))
        assert not (await store.memory.read()).full

    with_store(clean_redis, body)


def test_unused_sampling_sessions_expire_with_their_weights(
    clean_redis: str, tmp_path: Path
) -> None:
    from lockstep.scheduler.api.tenancy import Tenancy

    r = redis.Redis.from_url(clean_redis)
    unloaded: list[str] = []

    async def unload(adapters: list[str]) -> None:
        unloaded.extend(adapters)

    async def body(store: Store) -> None:
        old, fresh = "sess-1:sample:0", "sess-1:sample:1"
        old_dir = tmp_path / "checkpoints" / MODEL / "ephemeral" / old.replace(":", "_")
        old_dir.mkdir(parents=True)
        for sampler_id, created in ((old, time.time() - 100), (fresh, time.time())):
            await store.samplers.put(
                SamplerRecord(
                    sampler_id=sampler_id,
                    owner="o",
                    session_id="sess-1",
                    base_model="m",
                    adapter_dir=str(old_dir) if sampler_id == old else None,
                    adapter_id=sampler_id,
                    created=created,
                )
            )
        r.set(keys.sample_done_cursor(old, 0), 3)
        catalog: Any = type("Catalog", (), {"data_dir": tmp_path})()
        tenancy = Tenancy(
            TenancyConfig(sampler_expiry_s=50),
            store,
            catalog,
            residency=None,  # type: ignore[arg-type]
            accounting=None,  # type: ignore[arg-type]
            wake_clock=lambda: None,
            unload_adapters=unload,
        )
        assert await tenancy.expire_unused_samplers() == 1
        assert await store.samplers.get(old) is None and await store.samplers.get(fresh)
        assert r.smembers(keys.session_samplers("sess-1")) == {fresh.encode()}
        assert not r.exists(keys.sample_done_cursor(old, 0))
        assert not old_dir.exists() and unloaded == [old]
        assert await tenancy.expire_unused_samplers() == 0

    with_store(clean_redis, body)


def test_a_live_sessions_trace_keeps_its_retention_only(
    clean_redis: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A session that keeps writing never lets its trace expire: its old events go by age (and
    past a count), so a long-lived tenant's trace stays bounded."""
    from lockstep.scheduler.state import batch as batch_mod

    r = redis.Redis.from_url(clean_redis)
    key = keys.session_trace("sess-1")

    async def write(n: int, keep: int = 10_000) -> None:
        store = Store.from_url(clean_redis)
        try:
            async with store.batch() as batch:
                batch.trace({"sess-1": [f'{{"n": {i}}}' for i in range(n)]}, keep, 60)
        finally:
            await store.close()

    asyncio.run(write(500))
    assert r.xlen(key) == 500
    later = time.time() + 600  # ten retentions on
    monkeypatch.setattr(batch_mod.time, "time", lambda: later)
    asyncio.run(write(1))
    assert r.xlen(key) < 150  # whole stream nodes go at once: at most one stays
    asyncio.run(write(400, keep=200))
    assert r.xlen(key) < 350
