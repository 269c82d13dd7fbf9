"""One cycle's outcomes are committed one transaction per op, so a crash between two commits
loses nothing and applies nothing twice; and one tenant whose state cannot be restored fails
only its own requests. The real scheduler in-process on a real Redis, with FAKE engines."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import redis

from lockstep.v1 import scheduler_pb2 as pb

from .arithmetic_engine import features, initial_weights, read_weights
from .inprocess import OWNER, Scheduler, fb

LR = 0.25


@pytest.fixture()
def url(redis_url: str) -> str:
    url = redis_url.rsplit("/", 1)[0] + "/8"  # a database of its own on the shared server
    redis.Redis.from_url(url).flushdb()
    return url


@pytest.fixture()
def started(url: str, tmp_path: Path) -> Iterator[list[Scheduler]]:
    """Schedulers started in a test (a restart is a second one on the same Redis and data)."""
    running: list[Scheduler] = []
    yield running
    for sched in running:
        sched.close()


def _start(started: list[Scheduler], url: str, data: Path) -> Scheduler:
    sched = Scheduler(url, data)
    started.append(sched)
    return sched


def _result(sched: Scheduler, rid: str, cycles: int = 10) -> pb.FutureReply:
    for _ in range(cycles):
        reply = sched.stub.RetrieveFuture(pb.RetrieveFutureRequest(owner=OWNER, request_id=rid))
        if reply.WhichOneof("state") != "try_again":
            return reply
        sched.tick()
    raise AssertionError(f"{rid} still pending after {cycles} cycles")


def _create(sched: Scheduler, session: str, n: int, seed: int) -> str:
    create = pb.CreateModel(
        session_id=session,
        model_seq_id=n,
        base_model="Fake/arithmetic",
        lora_config=pb.LoraConfig(rank=1, seed=seed, train_mlp=True),
    )
    rid = sched.stub.Submit(pb.SubmitRequest(owner=OWNER, create_model=create)).request_id
    assert _result(sched, rid).WhichOneof("state") == "result"
    return f"{session}:train:{n}"


def _step(model: str, seq: int) -> pb.SubmitRequest:
    return pb.SubmitRequest(
        owner=OWNER,
        optim_step=pb.OptimStep(
            model_id=model, seq_id=seq, adam=pb.AdamParams(learning_rate=LR, beta1=0.9, beta2=0.95)
        ),
    )


def _save(model: str, seq: int, name: str) -> pb.SubmitRequest:
    return pb.SubmitRequest(
        owner=OWNER,
        save_weights=pb.SaveWeights(
            model_id=model, seq_id=seq, kind=pb.CHECKPOINT_KIND_TRAINING, name=name
        ),
    )


TOKENS = [3, 9, 27, 17, 51]


def test_a_crash_between_two_commits_of_a_cycle_loses_and_repeats_nothing(
    started: list[Scheduler], url: str, tmp_path: Path
) -> None:
    sched = _start(started, url, tmp_path)
    session = sched.stub.CreateSession(pb.CreateSessionRequest(owner=OWNER)).session_id
    model = _create(sched, session, 0, seed=5)
    rids = [
        sched.stub.Submit(req).request_id
        for req in (fb(model, 1, TOKENS), _step(model, 2), _save(model, 3, "after"))
    ]
    commit_cycle = sched.store.cycles.commit

    async def crash_after_the_first(pairs):  # type: ignore[no-untyped-def]
        assert [op.seq_id for op, _ in pairs] == [1, 2, 3]  # one cycle, one batch
        await commit_cycle(pairs[:1])  # Redis ran the first op's script, then the process died
        raise ConnectionError("scheduler killed between two commits")

    sched.store.cycles.commit = crash_after_the_first  # type: ignore[method-assign]
    with pytest.raises(ConnectionError):
        sched.tick()  # the pass is recorded; the step and the save (files written) are not
    assert sched.run(sched.store.cycles.progress(model)) == (2, 0)
    sched.close()
    started.remove(sched)

    fresh = _start(started, url, tmp_path)  # a new scheduler process: nothing resident
    replies = [_result(fresh, rid) for rid in rids]
    assert [r.WhichOneof("state") for r in replies] == ["result"] * 3, replies
    # The step's snapshot is written in the background (the fake reports it two cycles later):
    # until then the step is in the replay log, so the weights above were rebuilt from it.
    assert fresh.run(fresh.store.cycles.progress(model))[0] == 4
    expected = initial_weights(5) - LR * features([TOKENS])  # the pass applied exactly once
    saved = read_weights(tmp_path / "checkpoints" / model / "weights" / "after")
    np.testing.assert_allclose(saved, expected, rtol=0, atol=1e-12)


def test_a_tenant_that_cannot_be_restored_fails_alone(
    started: list[Scheduler], url: str, tmp_path: Path
) -> None:
    sched = _start(started, url, tmp_path)
    session = sched.stub.CreateSession(pb.CreateSessionRequest(owner=OWNER)).session_id
    broken, healthy = _create(sched, session, 0, seed=1), _create(sched, session, 1, seed=2)
    sched.close()
    started.remove(sched)
    shutil.rmtree(tmp_path / "state" / broken)  # its snapshot is lost

    fresh = _start(started, url, tmp_path)
    rids = {
        m: [
            fresh.stub.Submit(fb(m, 1, TOKENS)).request_id,
            fresh.stub.Submit(_step(m, 2)).request_id,
        ]
        for m in (broken, healthy)
    }
    fresh.tick()  # ONE cycle answers both tenants: no retry loop over the whole plan
    for rid in rids[broken]:
        reply = fresh.stub.RetrieveFuture(pb.RetrieveFutureRequest(owner=OWNER, request_id=rid))
        assert reply.WhichOneof("state") == "error", reply
        assert "could not be restored" in reply.error.message
    for rid in rids[healthy]:
        reply = fresh.stub.RetrieveFuture(pb.RetrieveFutureRequest(owner=OWNER, request_id=rid))
        assert reply.WhichOneof("state") == "result", reply
    assert fresh.run(fresh.store.cycles.progress(healthy))[0] == 3
    # the broken tenant's later requests are answered too (never stuck behind the failure)
    late = fresh.stub.Submit(fb(broken, 3, TOKENS)).request_id
    assert _result(fresh, late).WhichOneof("state") == "error"
    with pytest.raises(grpc.RpcError):  # and its seq_ids stay exactly-once
        fresh.stub.Submit(fb(broken, 3, [1, 2, 3]))


def test_a_background_snapshot_counts_once_durable_and_steps_replay_until_then(
    started: list[Scheduler], url: str, tmp_path: Path
) -> None:
    """The step's snapshot is recorded only once the engine reports it durable; before that the
    step is in the replay log, and a restart in between rebuilds the same weights from it."""
    sched = _start(started, url, tmp_path)
    session = sched.stub.CreateSession(pb.CreateSessionRequest(owner=OWNER)).session_id
    model = _create(sched, session, 0, seed=9)
    for rid in [
        sched.stub.Submit(fb(model, 1, TOKENS)).request_id,
        sched.stub.Submit(_step(model, 2)).request_id,
    ]:
        assert _result(sched, rid).WhichOneof("state") == "result"
    log = sched.run(sched.store.cycles.replay_log(model, 0))
    assert [(j.seq_id, j.kind) for j in log] == [(1, "forward_backward"), (2, "optim_step")]
    sched.trainer.restart()  # the in-flight snapshot is lost with the engine
    sched.run(sched.clock.recovery.record_durable())  # nothing reported
    assert sched.run(sched.store.cycles.progress(model)) == (3, 0)
    sched.close()
    started.remove(sched)

    fresh = _start(started, url, tmp_path)  # restores seq 0 + replays the pass and the step
    rid = fresh.stub.Submit(_save(model, 3, "replayed")).request_id
    assert _result(fresh, rid).WhichOneof("state") == "result"
    expected = initial_weights(9) - LR * features([TOKENS])
    saved = read_weights(tmp_path / "checkpoints" / model / "weights" / "replayed")
    np.testing.assert_allclose(saved, expected, rtol=0, atol=1e-12)
    rid = fresh.stub.Submit(_step(model, 4)).request_id  # a new step, a new snapshot
    assert _result(fresh, rid).WhichOneof("state") == "result"
    for _ in range(2):  # the fake reports it durable two calls later
        fresh.run(fresh.clock.recovery.record_durable())
    assert fresh.run(fresh.store.cycles.progress(model)) == (5, 4)
    assert fresh.run(fresh.store.cycles.replay_log(model, 0)) == []  # trimmed by the mark
    assert sorted(p.name for p in (tmp_path / "state" / model).iterdir()) == ["seq-4"]
