"""The Redis store against a real server: exactly-once claims, queues, job outcomes."""

from __future__ import annotations

import asyncio
import time

import pytest

from lockstep.scheduler.records import LoraRecord, ModelRecord
from lockstep.scheduler.store import ClaimConflict, Store


def model_record(model_id: str = "sess-1:train:0") -> ModelRecord:
    now = time.time()
    return ModelRecord(model_id=model_id, owner="o", session_id="sess-1", base_model="m",
                       lora=LoraRecord(rank=4), created=now, last_request_time=now)


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


def test_a_retried_request_is_claimed_once(clean_redis: str) -> None:
    async def go() -> None:
        store = Store.from_url(clean_redis)
        await store.put_model(model_record())
        kw = dict(owner="o", model_id="sess-1:train:0", seq_id=1, kind="forward_backward",
                  tokens=5)
        rid, created = await store.claim_training(payload=b"a", **kw)  # type: ignore[arg-type]
        again, created_again = await store.claim_training(payload=b"a", **kw)  # type: ignore[arg-type]
        assert created and not created_again and again == rid
        with pytest.raises(ClaimConflict):
            await store.claim_training(payload=b"b", **kw)  # type: ignore[arg-type]
        queues, next_seq = await store.queued_ops()
        assert [op.request_id for op in queues["sess-1:train:0"]] == [rid]
        assert next_seq == {"sess-1:train:0": 0}
        await store.close()

    run(go())


def test_concurrent_claims_of_one_seq_enqueue_once(clean_redis: str) -> None:
    async def go() -> None:
        store = Store.from_url(clean_redis)
        await store.put_model(model_record())
        results = await asyncio.gather(*[
            store.claim_training(owner="o", model_id="sess-1:train:0", seq_id=7,
                                 kind="optim_step", payload=b"same", tokens=0)
            for _ in range(20)])
        assert len({rid for rid, _ in results}) == 1
        assert sum(created for _, created in results) == 1
        queues, _ = await store.queued_ops()
        assert len(queues["sess-1:train:0"]) == 1
        await store.close()

    run(go())


def test_finishing_a_job_records_it_and_advances_the_model(clean_redis: str) -> None:
    async def go() -> None:
        store = Store.from_url(clean_redis)
        await store.put_model(model_record())
        rid, _ = await store.claim_training(owner="o", model_id="sess-1:train:0", seq_id=1,
                                            kind="forward_backward", payload=b"x", tokens=3)
        (op,) = (await store.queued_ops())[0]["sess-1:train:0"]
        await store.finish_job(op, result=b"result-bytes")
        job = await store.job(rid)
        assert job is not None and job.status == "done" and job.result == b"result-bytes"
        assert job.payload == b""  # payloads are dropped once served
        model = await store.model("sess-1:train:0")
        assert model is not None and model.next_seq == 2
        assert (await store.queued_ops())[0] == {}
        c1, c2 = await store.next_cycle(), await store.next_cycle()
        assert c2 == c1 + 1
        await store.close()

    run(go())


def test_a_rejected_request_is_failed_but_queued(clean_redis: str) -> None:
    async def go() -> None:
        store = Store.from_url(clean_redis)
        await store.put_model(model_record())
        rid, _ = await store.claim_training(owner="o", model_id="sess-1:train:0", seq_id=1,
                                            kind="rejected", payload=b"bad", tokens=0,
                                            rejection="weights: wrong length")
        job = await store.job(rid)
        assert job is not None and job.status == "failed" and job.category == "user"
        assert job.error == "weights: wrong length"
        (op,) = (await store.queued_ops())[0]["sess-1:train:0"]
        assert op.kind == "rejected"
        await store.close()

    run(go())
