"""A sampling session's futures in Redis (real Redis, real local sampler): each sample completes
once, in the log of its (sampling session, clone) that retrieve_futures reads; a cancel wins
over a later finish and a finish over a later cancel; a cancelled queued sample never reaches
the engine; joining clients get distinct clone ids."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from lockstep.engine.types import SampleRequest, SampleResult
from lockstep.modeling.tiny import DEFAULT_MODEL_NAME, ensure_default_model
from lockstep.observability import metrics
from lockstep.rollout.local import LocalSamplingEngine
from lockstep.scheduler.cycle.sampling_lane import SamplingLane
from lockstep.scheduler.state import keys, sample_futures
from lockstep.scheduler.state.futures import FutureBoard
from lockstep.scheduler.state.jobs import Job
from lockstep.scheduler.state.records import SamplerRecord
from lockstep.scheduler.state.store import Store
from lockstep.v1 import scheduler_pb2 as pb
from lockstep.vocab import JobStatus

SAMPLER = "sess-1:sample:0"
CLONE_1 = sample_futures.CLONE_SPAN  # the first seq_id of clone 1


async def _store(url: str) -> Store:
    """A store holding SAMPLER's record (owner "o")."""
    store = Store.from_url(url)
    await store.samplers.put(
        SamplerRecord(sampler_id=SAMPLER, owner="o", session_id="sess-1", base_model="m")
    )
    return store


async def _claim(store: Store, seq_id: int, max_tokens: int = 2) -> Job:
    payload = pb.SubmitRequest(
        owner="o",
        sample=pb.Sample(
            sampling_session_id=SAMPLER,
            seq_id=seq_id,
            prompt_tokens=[1, 2, 3],
            num_samples=1,
            params=pb.SamplingParams(max_tokens=max_tokens, temperature=1.0, top_k=-1, top_p=1.0),
        ),
    ).SerializeToString()
    rid, created = await store.jobs.claim_sample(
        owner="o", sampler_id=SAMPLER, seq_id=seq_id, payload=payload
    )
    assert created
    job = await store.jobs.get(rid)
    assert job is not None
    return job


def _ids(found: sample_futures.Completions) -> list[tuple[str, bool]]:
    return [(c.request_id, c.failed) for c in found.entries]


def test_completions_are_logged_per_clone_once_and_dropped_once_seen(clean_redis: str) -> None:
    async def go() -> None:
        store = await _store(clean_redis)
        a, b, c = [await _claim(store, s) for s in (1, 2, CLONE_1 + 1)]
        assert await sample_futures.finish(store, a, result=b"12345")
        assert await sample_futures.finish(store, c, error="engine said no")
        assert not await sample_futures.finish(store, a, result=b"again")  # once only
        assert await sample_futures.cancel(store, b) == sample_futures.Outcome.CANCELLED

        # another caller's poll is refused and acknowledges nothing
        assert await sample_futures.since(store, "intruder", SAMPLER, 0, 2) is None
        assert await sample_futures.since(store, "o", "sess-1:sample:9", 0, 0) is None
        first = await sample_futures.since(store, "o", SAMPLER, 0, 0)
        assert _ids(first) == [(a.request_id, False), (b.request_id, True)]
        assert first.entries[0].payload_size == 5
        assert first.cursor == 2
        other = await sample_futures.since(store, "o", SAMPLER, 1, 0)
        assert _ids(other) == [(c.request_id, True)]

        # prev_cursor acknowledges: those entries are gone, the cursor stays
        empty = await sample_futures.since(store, "o", SAMPLER, 0, first.cursor)
        assert (empty.entries, empty.cursor) == ([], first.cursor)
        assert await store.redis.zcard(keys.sample_done(SAMPLER, 0)) == 0
        with pytest.raises(sample_futures.CursorAhead, match="past the last completion"):
            await sample_futures.since(store, "o", SAMPLER, 0, first.cursor + 1)
        await store.close()

    asyncio.run(go())


def test_a_poll_sends_the_answers_along_within_its_prefetch_budget(
    clean_redis: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each completion comes with the job its retrieve_future would read (result, or error),
    while the poll's byte budget lasts; one past it comes without, and the next fits again."""
    monkeypatch.setattr(sample_futures, "PREFETCH_BYTES_PER_POLL", 10)

    async def go() -> None:
        store = await _store(clean_redis)
        a, b, c, d = [await _claim(store, s) for s in (1, 2, 3, 4)]
        assert await sample_futures.finish(store, a, result=b"123456")
        assert await sample_futures.finish(store, b, result=b"too long to fit")
        assert await sample_futures.finish(store, c, error="engine said no")
        assert await sample_futures.finish(store, d, result=b"1234")
        found = await sample_futures.since(store, "o", SAMPLER, 0, 0)
        assert _ids(found) == [(j.request_id, j is c) for j in (a, b, c, d)]
        assert set(found.answers) == {a.request_id, c.request_id, d.request_id}
        done, failed, last = (found.answers[j.request_id] for j in (a, c, d))
        assert (done.status, done.result) == (JobStatus.DONE, b"123456")
        assert (failed.status, failed.error, failed.result) == (
            JobStatus.FAILED,
            "engine said no",
            None,
        )
        assert (last.status, last.result) == (JobStatus.DONE, b"1234")  # 6 + 4 bytes: fits
        await store.close()

    asyncio.run(go())


def test_cancel_and_finish_race_whoever_writes_first_wins(clean_redis: str) -> None:
    async def go() -> None:
        store = Store.from_url(clean_redis)
        queued, done = await _claim(store, 1), await _claim(store, 2)
        assert await sample_futures.cancel(store, queued) == sample_futures.Outcome.CANCELLED
        job = await store.jobs.get(queued.request_id)
        assert job is not None and job.status == JobStatus.FAILED
        assert job.error == sample_futures.cancelled_message(queued.request_id)
        assert "cancelled" in (job.error or "")
        _, batch, _ = await store.cycles.sample_batch(10)
        assert queued.request_id not in [j.request_id for j in batch]
        # the lane finishing it afterwards (it was already in the engine) changes nothing
        assert not await sample_futures.finish(store, queued, result=b"late")
        job = await store.jobs.get(queued.request_id)
        assert job is not None and job.status == JobStatus.FAILED and job.result is None
        assert await sample_futures.cancel(store, queued) == sample_futures.Outcome.ALREADY_FAILED

        assert await sample_futures.finish(store, done, result=b"ok")
        assert await sample_futures.cancel(store, done) == sample_futures.Outcome.ALREADY_FINISHED
        job = await store.jobs.get(done.request_id)
        assert job is not None and (job.status, job.result) == (JobStatus.DONE, b"ok")
        await store.close()

    asyncio.run(go())


def test_joining_clients_get_distinct_clone_ids(clean_redis: str) -> None:
    async def go() -> None:
        store = Store.from_url(clean_redis)
        got = await asyncio.gather(*(sample_futures.join(store, SAMPLER) for _ in range(5)))
        assert sorted(got) == [1, 2, 3, 4, 5]  # the original client is 0
        assert await sample_futures.join(store, "sess-1:sample:1") == 1
        await store.close()

    asyncio.run(go())


class RecordingSampler(LocalSamplingEngine):
    """The local sampler, recording which requests reached it."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.seen: list[str] = []

    def sample_slice(self, requests: list[SampleRequest], steps: int) -> list[SampleResult]:
        self.seen.extend(r.request_id for r in requests)  # the lane's one way in
        return super().sample_slice(requests, steps)


@pytest.fixture(scope="module")
def sampler(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RecordingSampler]:
    engine = RecordingSampler(
        ensure_default_model(tmp_path_factory.mktemp("models")), DEFAULT_MODEL_NAME
    )
    yield engine
    engine.close()


def test_a_cancelled_queued_sample_never_reaches_the_engine(
    clean_redis: str, sampler: RecordingSampler
) -> None:
    async def go() -> None:
        store = await _store(clean_redis)
        board = FutureBoard(store)
        lane = SamplingLane(store, sampler, board)
        kept, cancelled = await _claim(store, 1), await _claim(store, 2)
        poll = asyncio.create_task(
            board.wait_until(
                sample_futures.topic(SAMPLER, 0),
                lambda: sample_futures.since(store, "o", SAMPLER, 0, 0),
                lambda found: len(found.entries) == 2,
                timeout=60,
            )
        )
        await asyncio.sleep(0)  # the poller waits before anything completes
        assert await sample_futures.cancel(store, cancelled) == sample_futures.Outcome.CANCELLED
        sampler.seen.clear()
        assert await lane.serve_once() == 1
        assert sampler.seen == [kept.request_id]
        found = await poll  # woken by the lane's finish, not by the timeout
        job = await store.jobs.get(kept.request_id)
        assert job is not None and job.status == JobStatus.DONE, job.error
        assert _ids(found) == [(cancelled.request_id, True), (kept.request_id, False)]
        job = await store.jobs.get(kept.request_id)
        assert job is not None and job.status == JobStatus.DONE
        await store.close()

    asyncio.run(go())


def test_the_lane_drops_a_sample_cancelled_while_its_batch_was_assembled(
    clean_redis: str, sampler: RecordingSampler
) -> None:
    """A cancel between the lane reading the queue and calling the engine (an adapter load can
    sit in between) still keeps the sample out of the engine."""

    async def go() -> None:
        store = await _store(clean_redis)
        board = FutureBoard(store)
        lane = SamplingLane(store, sampler, board)
        kept, cancelled = await _claim(store, 1), await _claim(store, 2)
        adapter_for = lane._adapter_for

        async def cancel_meanwhile(sampler_id: str, rec: SamplerRecord | None) -> str | None:
            # as the CancelFuture RPC does: the outcome, then the board hears of it
            await sample_futures.cancel(store, cancelled)
            board.cancelled(cancelled.request_id, sample_futures.job_topic(cancelled))
            return await adapter_for(sampler_id, rec)

        lane._adapter_for = cancel_meanwhile  # type: ignore[method-assign]
        sampler.seen.clear()
        await lane.serve_once()
        assert sampler.seen == [kept.request_id]
        job = await store.jobs.get(cancelled.request_id)
        assert job is not None and job.status == JobStatus.FAILED
        await store.close()

    asyncio.run(go())


def test_the_lane_answers_a_batch_in_two_round_trips(
    clean_redis: str, sampler: RecordingSampler
) -> None:
    """Its read (queue, jobs, samplers) and its answers (with usage and trace): no status
    re-read when nothing was cancelled meanwhile."""

    def trips() -> float:
        labels = {"caller": metrics.RedisCaller.OTHER}
        return metrics.SCHEDULER.get_sample_value("lockstep_redis_round_trips_total", labels) or 0

    async def go() -> None:
        store = await _store(clean_redis)
        lane = SamplingLane(store, sampler, FutureBoard(store))
        jobs = [await _claim(store, 1), await _claim(store, 2)]
        before = trips()
        assert await lane.serve_once() == 2
        assert trips() - before == 2
        for job in jobs:
            done = await store.jobs.get(job.request_id)
            assert done is not None and done.status == JobStatus.DONE, done
        await store.close()

    asyncio.run(go())


def test_a_log_nobody_acknowledges_keeps_only_its_newest_completions(
    clean_redis: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client that waits per request never acknowledges its log: it stays bounded."""
    monkeypatch.setattr(sample_futures, "MAX_LOGGED", 3)

    async def go() -> None:
        store = await _store(clean_redis)
        jobs = [await _claim(store, s) for s in range(1, 6)]
        for job in jobs:
            assert await sample_futures.finish(store, job, result=b"x")
        found = await sample_futures.since(store, "o", SAMPLER, 0, 0)
        assert [c.request_id for c in found.entries] == [j.request_id for j in jobs[2:]]
        assert found.cursor == 5
        await store.close()

    asyncio.run(go())


async def _counted_poll(
    store: Store, board: FutureBoard, reads: list[int], want: int
) -> asyncio.Task[sample_futures.Completions]:
    """A session poll from cursor 0 as RetrieveFutures waits (handed completions accepted),
    counting its reads of the log; returned once its first read is done."""
    first_read = asyncio.Event()

    async def read() -> sample_futures.Completions:
        reads.append(1)
        found = await sample_futures.since(store, "o", SAMPLER, 0, 0)
        assert found is not None
        first_read.set()
        return found

    poll = asyncio.create_task(
        board.wait_until(
            sample_futures.topic(SAMPLER, 0),
            read,
            lambda found: len(found.entries) >= want,
            timeout=60,
            finished=sample_futures.handed,
        )
    )
    await first_read.wait()  # it read the empty log and waits (a wake-up from now on counts)
    return poll


def test_a_waiting_poll_is_handed_what_the_lane_logged(
    clean_redis: str, sampler: RecordingSampler
) -> None:
    """The lane hands the completions it just logged (with their answers) to the poll waiting
    on their log: the poll answers without reading the log back, the same as a read would."""

    async def go() -> None:
        store = await _store(clean_redis)
        board = FutureBoard(store)
        lane = SamplingLane(store, sampler, board)
        jobs = [await _claim(store, 1), await _claim(store, 2)]
        reads: list[int] = []
        poll = await _counted_poll(store, board, reads, 2)
        assert await lane.serve_once() == 2
        found = await poll
        assert len(reads) == 1  # its first read only
        again = await sample_futures.since(store, "o", SAMPLER, 0, 0)
        assert again is not None
        assert found.entries == again.entries and found.cursor == again.cursor == 2
        assert sorted(found.answers) == sorted(j.request_id for j in jobs)
        for rid, answer in found.answers.items():
            stored = again.answers[rid]
            assert (answer.status, answer.result) == (stored.status, stored.result)
            assert answer.status == JobStatus.DONE and answer.result
        await store.close()

    asyncio.run(go())


def test_a_poll_reads_the_log_when_something_else_was_logged_between(
    clean_redis: str, sampler: RecordingSampler
) -> None:
    """A completion this process did not hand over (logged by another writer after the poll's
    read) breaks the run of cursors: the poll reads the log and misses nothing."""

    async def go() -> None:
        store = await _store(clean_redis)
        board = FutureBoard(store)
        lane = SamplingLane(store, sampler, board)
        elsewhere, here = await _claim(store, 1), await _claim(store, 2)
        reads: list[int] = []
        poll = await _counted_poll(store, board, reads, 1)
        assert await sample_futures.finish(store, elsewhere, error="another writer")  # no wake
        assert await lane.serve_once() == 1  # only `here` is still queued
        found = await poll
        assert len(reads) == 2
        assert _ids(found) == [(elsewhere.request_id, True), (here.request_id, False)]
        await store.close()

    asyncio.run(go())
