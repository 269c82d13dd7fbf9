"""The store's one-round-trip paths against a real Redis: claims with their limits inside the
script, a cycle's commits in one pipeline, a model read with its session, decoded passes."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from lockstep.engine.types import Datum, PassRequest
from lockstep.scheduler.admission.decoded import DecodedPasses
from lockstep.scheduler.state import commit
from lockstep.scheduler.state.claims import QueueFull, TrainingClaim
from lockstep.scheduler.state.futures import FutureBoard
from lockstep.scheduler.state.outcome import Outcome
from lockstep.scheduler.state.records import CheckpointRecord, SessionRecord
from lockstep.scheduler.state.store import Store
from lockstep.v1 import scheduler_pb2 as pb
from tests.unit.test_store import RESULT, _queue, model_record

MODEL = "sess-1:train:0"


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


def _claim(seq: int, payload: bytes = b"x", backlog: int = 0) -> TrainingClaim:
    return TrainingClaim(
        owner="o",
        model_id=MODEL,
        seq_id=seq,
        kind="forward_backward",  # type: ignore[arg-type]
        payload=payload,
        tokens=1,
        backlog=backlog,
    )


def _checkpoint(name: str) -> CheckpointRecord:
    return CheckpointRecord(
        checkpoint_id=f"weights/{name}",
        checkpoint_type="training",  # type: ignore[arg-type]
        tinker_path=f"tinker://{MODEL}/weights/{name}",
        directory="/nowhere",
        time=time.time(),
    )


def test_a_full_queue_refuses_new_requests_but_answers_retries(clean_redis: str) -> None:
    async def go() -> None:
        store = Store.from_url(clean_redis)
        await store.runs.put(model_record())
        first, _ = await store.jobs.claim_training(_claim(1, backlog=2))
        await store.jobs.claim_training(_claim(2, backlog=2))
        with pytest.raises(QueueFull) as refused:
            await store.jobs.claim_training(_claim(3, backlog=2))
        assert refused.value.queued == 2
        # A retry of a queued request is answered, not refused (it adds nothing to the queue).
        assert await store.jobs.claim_training(_claim(1, backlog=2)) == (first, False)
        assert len((await store.cycles.queued_ops())[0][MODEL]) == 2
        await store.close()

    run(go())


def test_a_full_sample_queue_refuses_new_samples_but_answers_retries(clean_redis: str) -> None:
    async def go() -> None:
        store = Store.from_url(clean_redis)
        kw = dict(owner="o", sampler_id="sess-1:sample:0", backlog=1)
        rid, created = await store.jobs.claim_sample(seq_id=1, payload=b"a", **kw)  # type: ignore[arg-type]
        assert created
        with pytest.raises(QueueFull):
            await store.jobs.claim_sample(seq_id=2, payload=b"b", **kw)  # type: ignore[arg-type]
        assert await store.jobs.claim_sample(seq_id=1, payload=b"a", **kw) == (rid, False)  # type: ignore[arg-type]
        assert [job.request_id for job in (await store.cycles.sample_batch(10))[1]] == [rid]
        await store.close()

    run(go())


def test_two_saves_of_one_model_in_one_batch_both_reach_its_record(clean_redis: str) -> None:
    async def go() -> None:
        store = Store.from_url(clean_redis)
        await store.runs.put(model_record())
        a, b = await _queue(store, MODEL, ["save", "save"])
        done = await store.cycles.commit(
            [
                (a, Outcome(RESULT, checkpoint=_checkpoint("a"))),
                (b, Outcome(RESULT, checkpoint=_checkpoint("b"))),
            ]
        )
        assert done == [True, True]
        rec = await store.runs.get(MODEL)
        assert rec is not None and rec.last_checkpoint == "weights/b"
        assert [c.checkpoint_id for c in await store.checkpoints.of_run(MODEL)] == [
            "weights/a",
            "weights/b",
        ]
        assert await store.cycles.progress(MODEL) == (3, None)
        assert await store.cycles.commit([(a, Outcome(RESULT))]) == [False]  # committed already
        await store.close()

    run(go())


def test_a_model_record_changed_under_a_commit_is_read_again(
    clean_redis: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The save's script compares the model record with the one read before the pipeline; a
    record that moved meanwhile is read again, so neither change is lost."""

    async def go() -> None:
        store = Store.from_url(clean_redis)
        await store.runs.put(model_record())
        (save,) = await _queue(store, MODEL, ["save"])
        read = commit._models_before
        calls = 0

        async def read_then_change(*args):  # type: ignore[no-untyped-def]
            nonlocal calls
            calls += 1
            found = await read(*args)
            if calls == 1:  # someone else writes the record between the read and the script
                changed = model_record()
                changed.user_metadata = {"k": "v"}
                await store.runs.put(changed)
            return found

        monkeypatch.setattr(commit, "_models_before", read_then_change)
        assert await store.cycles.commit_one(save, Outcome(RESULT, checkpoint=_checkpoint("a")))
        assert calls == 2
        rec = await store.runs.get(MODEL)
        assert rec is not None and rec.last_checkpoint == "weights/a"
        assert rec.user_metadata == {"k": "v"}
        await store.close()

    run(go())


def test_a_model_is_read_with_its_session(clean_redis: str) -> None:
    async def go() -> None:
        store = Store.from_url(clean_redis)
        assert await store.runs.with_session(MODEL) == (None, None)
        await store.runs.put(model_record())
        model, session = await store.runs.with_session(MODEL)
        assert model is not None and (model.model_id, model.owner) == (MODEL, "o")
        assert session is None  # the session record is gone
        rec = SessionRecord(session_id="sess-1", owner="o", created=1.0, last_heartbeat=1.0)
        await store.sessions.put(rec)
        assert (await store.runs.with_session(MODEL))[1] == rec
        await store.close()

    run(go())


def _pass(tokens: int) -> PassRequest:
    datum = Datum(
        tokens=np.zeros(tokens, dtype=np.int64),
        loss_inputs={"target_tokens": np.zeros(tokens, dtype=np.int64)},
    )
    return PassRequest("", MODEL, "cross_entropy", {}, False, [datum])


def test_decoded_passes_are_taken_once_and_bounded() -> None:
    held = DecodedPasses(max_values=100)
    held.keep("req-a", _pass(10))
    held.keep("req-big", _pass(60))  # 120 values: more than the whole bound, never held
    assert "req-a" in held and "req-big" not in held
    taken = held.take("req-a")
    assert taken is not None and taken.request_id == "req-a"
    assert held.take("req-a") is None  # a re-run reads the payload again
    for i in range(10):  # 20 values each: the oldest make room
        held.keep(f"req-{i}", _pass(10))
    assert "req-0" not in held and "req-9" in held


def test_the_job_result_is_the_bytes_the_outcome_carried(clean_redis: str) -> None:
    async def go() -> None:
        store = Store.from_url(clean_redis)
        await store.runs.put(model_record())
        (op,) = await _queue(store, MODEL, ["forward_backward"])
        result = pb.JobResult(optim_step=pb.OptimStepResult(metrics={"x": 2.0}))
        assert await store.cycles.commit([(op, Outcome(result))]) == [True]
        job = await store.jobs.get(op.request_id)
        assert job is not None and job.result == result.SerializeToString()
        await store.close()

    run(go())


def test_a_waiting_future_gets_the_committed_outcome_without_reading_it_back(
    clean_redis: str,
) -> None:
    async def go() -> None:
        store = Store.from_url(clean_redis)
        board = FutureBoard(store)
        await store.runs.put(model_record())
        (op,) = await _queue(store, MODEL, ["forward_backward"])
        waiting = asyncio.create_task(board.wait(op.request_id, timeout=30))
        while not board.waiting(op.request_id):  # registered: a wake-up from now on reaches it
            await asyncio.sleep(0.01)
        board.notify(op.request_id, value=Outcome(RESULT).recorded())  # not committed in Redis
        job = await waiting
        assert job is not None and job.status == "done" and job.result == RESULT.SerializeToString()
        assert job.owner == "o" and job.request_id == op.request_id  # from its first read
        stored = await store.jobs.get(op.request_id, payload=False)
        assert stored is not None and stored.status == "pending"  # so it was not read back
        # A wake-up without the outcome (a sample, a cancel) reads it.
        again = asyncio.create_task(board.wait(op.request_id, timeout=30))
        while not board.waiting(op.request_id):
            await asyncio.sleep(0.01)
        board.notify(op.request_id)
        reread = await again
        assert reread is not None and reread.status == "pending"
        await store.close()

    run(go())
