"""The Redis store against a real server: exactly-once claims, queues, job outcomes."""

from __future__ import annotations

import ast
import asyncio
import dataclasses
import time
from pathlib import Path

import pytest

import lockstep
from lockstep.scheduler.state import commit, keys
from lockstep.scheduler.state.claims import (
    ClaimConflict,
    NotLive,
    TenantLimitReached,
    TrainingClaim,
)
from lockstep.scheduler.state.outcome import Outcome
from lockstep.scheduler.state.records import (
    LoraRecord,
    ModelRecord,
    SamplerRecord,
    SessionRecord,
)
from lockstep.scheduler.state.store import Store
from lockstep.v1 import scheduler_pb2 as pb

RESULT = pb.JobResult(optim_step=pb.OptimStepResult(metrics={"grad_norm:mean": 1.0}))


def done(snapshot_seq: int | None = None) -> Outcome:
    """A successful pass or step, as its op builds it: replayed until a snapshot covers it."""
    return Outcome(RESULT, snapshot_seq=snapshot_seq, replayed=True)


def model_record(model_id: str = "sess-1:train:0") -> ModelRecord:
    now = time.time()
    return ModelRecord(
        model_id=model_id,
        owner="o",
        session_id="sess-1",
        base_model="m",
        lora=LoraRecord(rank=4),
        created=now,
        last_request_time=now,
    )


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


def test_a_retried_request_is_claimed_once(clean_redis: str) -> None:
    async def go() -> None:
        store = Store.from_url(clean_redis)
        await store.runs.put(model_record())
        kw = dict(owner="o", model_id="sess-1:train:0", seq_id=1, kind="forward_backward", tokens=5)
        rid, created = await store.jobs.claim_training(TrainingClaim(payload=b"a", **kw))  # type: ignore[arg-type]
        again, created_again = await store.jobs.claim_training(TrainingClaim(payload=b"a", **kw))  # type: ignore[arg-type]
        assert created and not created_again and again == rid
        with pytest.raises(ClaimConflict):
            await store.jobs.claim_training(TrainingClaim(payload=b"b", **kw))  # type: ignore[arg-type]
        queues, next_seq = await store.cycles.queued_ops()
        assert [op.request_id for op in queues["sess-1:train:0"]] == [rid]
        assert next_seq == {"sess-1:train:0": 0}
        await store.close()

    run(go())


def test_concurrent_claims_of_one_seq_enqueue_once(clean_redis: str) -> None:
    async def go() -> None:
        store = Store.from_url(clean_redis)
        await store.runs.put(model_record())
        results = await asyncio.gather(
            *[
                store.jobs.claim_training(
                    TrainingClaim(
                        owner="o",
                        model_id="sess-1:train:0",
                        seq_id=7,
                        kind="optim_step",
                        payload=b"same",
                        tokens=0,
                    )
                )
                for _ in range(20)
            ]
        )
        assert len({rid for rid, _ in results}) == 1
        assert sum(created for _, created in results) == 1
        queues, _ = await store.cycles.queued_ops()
        assert len(queues["sess-1:train:0"]) == 1
        await store.close()

    run(go())


def test_finishing_a_job_records_it_and_advances_the_model(clean_redis: str) -> None:
    async def go() -> None:
        store = Store.from_url(clean_redis)
        await store.runs.put(model_record())
        rid, _ = await store.jobs.claim_training(
            TrainingClaim(
                owner="o",
                model_id="sess-1:train:0",
                seq_id=1,
                kind="forward_backward",
                payload=b"x",
                tokens=3,
            )
        )
        (op,) = (await store.cycles.queued_ops())[0]["sess-1:train:0"]
        assert await store.cycles.commit_one(op, done())
        job = await store.jobs.get(rid)
        assert job is not None and job.status == "done" and job.result == RESULT.SerializeToString()
        outcome = await store.jobs.get(rid, payload=False)  # what a future reads: no payload
        assert outcome is not None and outcome.payload == b"" and job.payload == b"x"
        assert outcome == dataclasses.replace(job, payload=b"")
        assert await store.jobs.get("req-unknown", payload=False) is None
        assert await store.cycles.progress("sess-1:train:0") == (2, None)
        (job,) = await store.cycles.replay_log("sess-1:train:0", after_seq=0)
        assert job.request_id == rid and job.payload == b"x"  # kept until the next snapshot
        assert (await store.cycles.queued_ops())[0] == {}
        (c1, _), (c2, _) = await store.cycles.begin([]), await store.cycles.begin([])
        assert c2 == c1 + 1
        await store.close()

    run(go())


def test_cycle_numbers_continue_from_the_last_commit_after_a_restart(clean_redis: str) -> None:
    """A scheduler numbers its cycles in process from the stored number; a commit stores the
    number reached, so a restarted one continues after it, and a cycle that never committed
    left nothing under its number (it may be given again)."""

    async def go() -> None:
        first = Store.from_url(clean_redis)
        assert [(await first.cycles.begin([]))[0] for _ in range(3)] == [1, 2, 3]
        assert await first.cycles.commit([]) == []
        assert (await first.cycles.begin([]))[0] == 4  # begun, never committed: the process dies
        restarted = Store.from_url(clean_redis)
        assert (await restarted.cycles.begin([]))[0] == 4
        assert await restarted.cycles.commit([]) == []
        stale = Store.from_url(clean_redis)  # a number behind never moves the stored one back
        await commit.commit_ops(stale.redis, 60, [], clock=2)
        assert int(await stale.redis.get(keys.CLOCK)) == 4
        for store in (first, restarted, stale):
            await store.close()

    run(go())


def test_a_claim_on_an_existing_model_checks_it_is_live(clean_redis: str) -> None:
    """With the model's session named, the claim itself refuses a model that is gone, or whose
    session is gone or ended (nothing is queued); a live one is claimed."""

    async def go() -> None:
        store = Store.from_url(clean_redis)

        def claim(seq_id: int) -> TrainingClaim:
            return TrainingClaim(
                owner="o",
                model_id="sess-1:train:0",
                seq_id=seq_id,
                kind="optim_step",
                payload=b"x",
                tokens=0,
                live_session="sess-1",
            )

        with pytest.raises(NotLive) as gone:
            await store.jobs.claim_training(claim(1))
        assert gone.value.state == "no_record"
        await store.runs.put(model_record())
        with pytest.raises(NotLive) as no_session:
            await store.jobs.claim_training(claim(1))
        assert no_session.value.state == "no_session"
        now = time.time()
        session = SessionRecord(session_id="sess-1", owner="o", created=now, last_heartbeat=now)
        await store.sessions.put(session)
        rid, created = await store.jobs.claim_training(claim(1))
        assert created
        session.finished = True
        await store.sessions.put(session)
        with pytest.raises(NotLive) as ended:
            await store.jobs.claim_training(claim(2))
        assert ended.value.state == "ended"
        queued, _ = await store.cycles.queued_ops()
        assert [op.request_id for op in queued["sess-1:train:0"]] == [rid]  # only the live one

        async def sample(sampler_id: str, seq_id: int) -> tuple[str, bool]:
            return await store.jobs.claim_sample(
                owner="o", sampler_id=sampler_id, seq_id=seq_id, payload=b"s", live_session="sess-1"
            )

        with pytest.raises(NotLive) as no_sampler:
            await sample("sess-1:sample:0", 1)
        assert no_sampler.value.state == "no_record"
        await store.samplers.put(
            SamplerRecord(
                sampler_id="sess-1:sample:0", owner="o", session_id="sess-1", base_model="m"
            )
        )
        with pytest.raises(NotLive) as sampler_ended:
            await sample("sess-1:sample:0", 1)
        assert sampler_ended.value.state == "ended"
        session.finished = False
        await store.sessions.put(session)
        assert (await sample("sess-1:sample:0", 1))[1]
        await store.close()

    run(go())


def test_a_rejected_request_is_failed_but_queued(clean_redis: str) -> None:
    async def go() -> None:
        store = Store.from_url(clean_redis)
        await store.runs.put(model_record())
        rid, _ = await store.jobs.claim_training(
            TrainingClaim(
                owner="o",
                model_id="sess-1:train:0",
                seq_id=1,
                kind="rejected",
                payload=b"bad",
                tokens=0,
                rejection="weights: wrong length",
            )
        )
        job = await store.jobs.get(rid)
        assert job is not None and job.status == "failed" and job.category == "user"
        assert job.error == "weights: wrong length"
        (op,) = (await store.cycles.queued_ops())[0]["sess-1:train:0"]
        assert op.kind == "rejected"
        await store.close()

    run(go())


def test_an_outcome_not_replayed_leaves_no_log_entry(clean_redis: str) -> None:
    """A forward pass changes nothing to rebuild: its op does not mark it replayed, so its
    payload goes with the commit (the replay log holds only what a restore re-runs)."""

    async def go() -> None:
        store = Store.from_url(clean_redis)
        model = "sess-1:train:0"
        await store.runs.put(model_record())
        (fwd,) = await _queue(store, model, ["forward"])
        assert await store.cycles.commit_one(fwd, Outcome(RESULT))
        assert await store.cycles.replay_log(model, after_seq=0) == []
        job = await store.jobs.get(fwd.request_id)
        assert job is not None and job.status == "done" and job.payload == b""
        await store.close()

    run(go())


def test_a_snapshot_empties_the_replay_log(clean_redis: str) -> None:
    async def go() -> None:
        store = Store.from_url(clean_redis)
        model = "sess-1:train:0"
        await store.runs.put(model_record())
        for seq, kind in (
            (1, "forward_backward"),
            (2, "forward_backward"),
            (3, "optim_step"),
            (4, "forward_backward"),
        ):
            await store.jobs.claim_training(
                TrainingClaim(
                    owner="o",
                    model_id=model,
                    seq_id=seq,
                    kind=kind,
                    payload=f"p{seq}".encode(),
                    tokens=1,
                )
            )
        ops = (await store.cycles.queued_ops())[0][model]
        for op in ops[:2]:
            await store.cycles.commit_one(op, done())
        assert [j.seq_id for j in await store.cycles.replay_log(model, after_seq=0)] == [1, 2]
        await store.cycles.commit_one(ops[2], done(snapshot_seq=3))
        await store.cycles.commit_one(ops[3], done())
        assert await store.cycles.progress(model) == (5, 3)
        assert [j.seq_id for j in await store.cycles.replay_log(model, after_seq=3)] == [4]
        first = await store.jobs.get(ops[0].request_id)
        assert first is not None and first.payload == b""  # dropped once a snapshot covers it
        await store.close()

    run(go())


def test_a_claim_racing_the_idle_check_keeps_the_model_active(clean_redis: str) -> None:
    """queued_ops drops an idle model from the active set; a request claimed between its read of
    the (empty) queue and the removal must keep the model active, or the request would wait for
    the model's next submission (seen as a forward_backward_custom that never completed)."""

    async def go() -> None:
        store = Store.from_url(clean_redis)
        await store.runs.put(model_record())
        rid, _ = await store.jobs.claim_training(
            TrainingClaim(
                owner="o",
                model_id="sess-1:train:0",
                seq_id=1,
                kind="forward_backward",
                payload=b"x",
                tokens=3,
            )
        )
        (op,) = (await store.cycles.queued_ops())[0]["sess-1:train:0"]
        await store.cycles.commit_one(op, done())  # the queue is empty, the model still active
        # The idle model leaves the active set in the same script that found its queue empty,
        # so a claim can only come before (it is read) or after (it re-adds the model).
        assert (await store.cycles.queued_ops())[0] == {}
        assert not await store.redis.sismember(keys.ACTIVE_MODELS, "sess-1:train:0")
        await store.jobs.claim_training(
            TrainingClaim(
                owner="o",
                model_id="sess-1:train:0",
                seq_id=2,
                kind="forward_backward",
                payload=b"y",
                tokens=3,
            )
        )
        (late,) = (await store.cycles.queued_ops())[0]["sess-1:train:0"]
        assert late.seq_id == 2 and late.request_id != rid
        await store.close()

    run(go())


def test_a_retry_is_matched_by_its_identity_not_its_bytes(clean_redis: str) -> None:
    """The SDK retries save_weights_and_get_sampling_client with a new sampling_session_seq_id;
    Submissions passes an identity without it, so the retry gets the first request back."""
    from lockstep.scheduler.admission.submissions import retry_identity
    from lockstep.v1 import scheduler_pb2 as pb

    def save(sampling_seq: int | None, name: str | None = None) -> pb.SubmitRequest:
        op = pb.SaveWeights(model_id="sess-1:train:0", seq_id=3, kind=pb.CHECKPOINT_KIND_SAMPLER)
        if sampling_seq is not None:
            op.sampling_session_seq_id = sampling_seq
        if name is not None:
            op.name = name
        return pb.SubmitRequest(owner="o", save_weights=op)

    first, retry = save(4), save(5)
    assert retry_identity(first) == retry_identity(retry) is not None
    assert retry_identity(save(None, "a")) is None  # a named save: the payload is its identity
    assert retry_identity(pb.SubmitRequest(owner="o", optim_step=pb.OptimStep())) is None

    async def go() -> None:
        store = Store.from_url(clean_redis)
        await store.runs.put(model_record())
        kw = dict(owner="o", model_id="sess-1:train:0", seq_id=3, kind="save_weights", tokens=0)
        rid, created = await store.jobs.claim_training(
            TrainingClaim(  # type: ignore[arg-type]
                payload=first.SerializeToString(), identity=retry_identity(first), **kw
            )
        )
        again, created_again = await store.jobs.claim_training(
            TrainingClaim(  # type: ignore[arg-type]
                payload=retry.SerializeToString(), identity=retry_identity(retry), **kw
            )
        )
        assert created and not created_again and again == rid
        with pytest.raises(ClaimConflict):  # another name under the same seq_id is not a retry
            await store.jobs.claim_training(
                TrainingClaim(  # type: ignore[arg-type]
                    payload=save(None, "b").SerializeToString(), **kw
                )
            )
        await store.close()

    run(go())


def _new_run(n: int, owner: str) -> ModelRecord:
    now = time.time()
    return ModelRecord(
        model_id=f"sess-{owner}:train:{n}",
        owner=owner,
        session_id=f"sess-{owner}",
        base_model="m",
        lora=LoraRecord(rank=4),
        created=now,
        last_request_time=now,
    )


async def _create(store: Store, n: int, owner: str, per_key: int, total: int) -> bool:
    run = _new_run(n, owner)
    try:
        await store.jobs.claim_training(
            TrainingClaim(
                owner=owner,
                model_id=run.model_id,
                seq_id=0,
                kind="create_model",
                payload=f"{owner}{n}".encode(),
                tokens=0,
                new_model=run,
                max_runs_per_key=per_key,
                max_runs=total,
            )
        )
    except TenantLimitReached as exc:
        assert exc.limit == ("max_tenants_per_key" if per_key else "max_tenants")
        assert exc.count == exc.most == (per_key or total)
        return False
    return True


def test_concurrent_creations_never_pass_the_tenant_quotas(clean_redis: str) -> None:
    """Eight creations at once, each on its own connection: the count is read under the claim's
    WATCH, so exactly the quota succeeds (a read-then-write check lets several through)."""

    async def go() -> None:
        stores = [Store.from_url(clean_redis) for _ in range(8)]
        made = await asyncio.gather(*[_create(s, n, "k", 3, 0) for n, s in enumerate(stores)])
        assert sum(made) == 3
        assert await stores[0].redis.zcard(keys.owner_runs("k")) == 3
        # a retried creation of an existing run is not a new tenant: it passes at the quota
        first = made.index(True)
        assert await _create(stores[0], first, "k", 3, 0)
        # the server-wide limit, across keys
        made = await asyncio.gather(*[_create(s, 0, f"o{n}", 0, 5) for n, s in enumerate(stores)])
        assert sum(made) == 2  # 3 runs of "k" already held
        for s in stores:
            await s.close()

    run(go())


async def _queue(store: Store, model: str, kinds: list[str]) -> list:  # type: ignore[type-arg]
    for seq, kind in enumerate(kinds, start=1):
        await store.jobs.claim_training(
            TrainingClaim(  # type: ignore[arg-type]
                owner="o",
                model_id=model,
                seq_id=seq,
                kind=kind,
                payload=f"p{seq}".encode(),
                tokens=1,
                rejection="tokens: out of range" if kind == "rejected" else None,
            )
        )
    return (await store.cycles.queued_ops())[0][model]


def test_progress_never_moves_backwards_whatever_the_commit_order(clean_redis: str) -> None:
    """The hang: a rejected seq 1 committed after the pass at seq 2 used to set next_seq = 2
    while seq 2 was done, so seq 3 waited forever. The store takes the max, whatever the order."""

    async def go() -> None:
        store = Store.from_url(clean_redis)
        model = "sess-1:train:0"
        await store.runs.put(model_record())
        rejected, fb, optim = await _queue(
            store, model, ["rejected", "forward_backward", "optim_step"]
        )
        await store.cycles.commit_one(fb, done())
        await store.cycles.commit_one(optim, done(snapshot_seq=3))
        await store.cycles.commit_one(rejected, Outcome())  # late: must not move the model back
        assert await store.cycles.progress(model) == (4, 3)
        job = await store.jobs.get(rejected.request_id)
        assert job is not None and job.status == "failed" and job.error == "tokens: out of range"
        assert (await store.cycles.queued_ops())[0] == {}
        await store.close()

    run(go())


def test_a_snapshot_mark_never_moves_backwards(clean_redis: str) -> None:
    async def go() -> None:
        store = Store.from_url(clean_redis)
        model = "sess-1:train:0"
        await store.runs.put(model_record())
        ops = await _queue(store, model, ["optim_step", "optim_step"])
        await store.cycles.commit_one(ops[1], done(snapshot_seq=2))
        await store.cycles.commit_one(ops[0], done(snapshot_seq=1))
        assert await store.cycles.progress(model) == (3, 2)
        await store.close()

    run(go())


def test_commit_is_idempotent(clean_redis: str) -> None:
    """A second commit of the same op (a re-run after a crash) changes nothing."""

    async def go() -> None:
        store = Store.from_url(clean_redis)
        model = "sess-1:train:0"
        await store.runs.put(model_record())
        (fb,) = await _queue(store, model, ["forward_backward"])
        assert await store.cycles.commit_one(fb, done())
        assert not await store.cycles.commit_one(fb, Outcome(error="boom"))
        job = await store.jobs.get(fb.request_id)
        assert job is not None and job.status == "done" and job.error is None
        assert [j.seq_id for j in await store.cycles.replay_log(model, after_seq=0)] == [1]
        await store.close()

    run(go())


def test_commit_records_the_checkpoint_the_model_and_the_sampler_together(clean_redis: str) -> None:
    from lockstep.scheduler.state.records import CheckpointRecord, SamplerRecord

    async def go() -> None:
        store = Store.from_url(clean_redis)
        model = "sess-1:train:0"
        await store.runs.put(model_record())
        (save,) = await _queue(store, model, ["save"])
        ckpt = CheckpointRecord(
            checkpoint_id="sampler_weights/a",
            checkpoint_type="sampler",
            tinker_path=f"tinker://{model}/sampler_weights/a",
            directory="/nowhere",
            time=time.time(),
        )
        sampler = SamplerRecord(
            sampler_id="sess-1:sample:0", owner="o", session_id="sess-1", base_model="m"
        )
        saved = Outcome(RESULT, checkpoint=ckpt, sampler=sampler)
        assert await store.cycles.commit_one(save, saved)
        rec = await store.runs.get(model)
        assert rec is not None and rec.last_sampler_checkpoint == "sampler_weights/a"
        assert (await store.checkpoints.get(model, "sampler_weights/a")) == ckpt
        assert await store.samplers.get("sess-1:sample:0") == sampler
        assert await store.cycles.progress(model) == (2, None)
        await store.close()

    run(go())


def test_only_the_state_layer_talks_to_redis() -> None:
    """Every Redis access in the scheduler goes through `scheduler/state/`: no other module
    imports redis or reaches for a `.redis` connection."""
    root = Path(lockstep.__file__).parent / "scheduler"
    offenders = []
    for path in sorted(root.rglob("*.py")):
        if path.parent == root / "state":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "redis":
                offenders.append(f"{path.relative_to(root)}:{node.lineno} .redis")
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            offenders += [
                f"{path.relative_to(root)} imports {n}"
                for n in names
                if n == "redis" or n.startswith("redis.")
            ]
    assert offenders == []
