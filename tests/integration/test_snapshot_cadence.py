"""Snapshots once per --snapshot-interval, not at every step: the steps between two stay in the
replay log (their results keep no TTL yet), an idle run gets its pending steps snapshotted,
a run leaving the engine takes its snapshot with it, and a crash at any point rebuilds the same
weights from the last durable snapshot + the log. The real scheduler in-process on a real Redis,
with the FAKE arithmetic engines (`arithmetic_engine`); "time passing" is the interval set to 0.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import redis

from lockstep.scheduler.state import keys
from lockstep.v1 import scheduler_pb2 as pb

from .arithmetic_engine import features, initial_weights, read_weights
from .inprocess import OWNER, Scheduler, fb
from .test_cycle_commit import TOKENS, _create, _result, _save, _step

LR = 0.25
NEVER = 3600.0  # an interval no test outlives: nothing is due by time


@pytest.fixture()
def url(redis_url: str) -> str:
    url = redis_url.rsplit("/", 1)[0] + "/9"  # a database of its own on the shared server
    redis.Redis.from_url(url).flushdb()
    return url


@pytest.fixture()
def started() -> Iterator[list[Scheduler]]:
    running: list[Scheduler] = []
    yield running
    for sched in running:
        sched.close()


def _start(started: list[Scheduler], url: str, data: Path, interval: float) -> Scheduler:
    sched = Scheduler(url, data, snapshot_interval_s=interval)
    started.append(sched)
    return sched


def _train(sched: Scheduler, model: str, first_seq: int) -> list[str]:
    """A pass then a step (seq first_seq, first_seq + 1), answered; their request ids."""
    rids = [
        sched.stub.Submit(fb(model, first_seq, TOKENS)).request_id,
        sched.stub.Submit(_step(model, first_seq + 1)).request_id,
    ]
    for rid in rids:
        assert _result(sched, rid).WhichOneof("state") == "result"
    return rids


def _durable(sched: Scheduler) -> None:
    for _ in range(2):  # the fake engine reports a background snapshot two calls later
        sched.run(sched.clock.recovery.record_durable())


def _crash_and_check(
    started: list[Scheduler], sched: Scheduler, url: str, data: Path, model: str, seed: int
) -> None:
    """Kill the engine (in-flight snapshots lost) and the scheduler; a fresh one restores the
    model from its durable snapshot + replay log: both steps applied exactly once."""
    sched.trainer.restart()
    sched.close()
    started.remove(sched)
    fresh = _start(started, url, data, NEVER)
    seq = fresh.run(fresh.store.cycles.progress(model))[0]
    rid = fresh.stub.Submit(_save(model, seq, "after-crash")).request_id
    assert _result(fresh, rid).WhichOneof("state") == "result"
    expected = initial_weights(seed) - 2 * LR * features([TOKENS])
    saved = read_weights(data / "checkpoints" / model / "weights" / "after-crash")
    np.testing.assert_allclose(saved, expected, rtol=0, atol=1e-12)


def test_steps_between_snapshots_replay_and_an_idle_run_is_snapshotted(
    started: list[Scheduler], url: str, tmp_path: Path
) -> None:
    sched = _start(started, url, tmp_path, NEVER)
    session = sched.stub.CreateSession(pb.CreateSessionRequest(owner=OWNER)).session_id
    model = _create(sched, session, 0, seed=3)  # durable snapshot at seq 0
    first = _train(sched, model, 1)
    _durable(sched)
    assert sched.run(sched.store.cycles.progress(model)) == (3, 0), "a step within the interval"
    log = sched.run(sched.store.cycles.replay_log(model, 0))
    assert [j.seq_id for j in log] == [1, 2]
    raw = redis.Redis.from_url(url)
    assert raw.ttl(keys.job(first[1])) == -1, "a step no snapshot holds keeps its result"

    sched.clock.recovery.cadence.interval_s = 0.0  # the interval has passed; no new step
    _durable(sched)  # the idle clock snapshots the pending step, then records it
    assert sched.run(sched.store.cycles.progress(model)) == (3, 2)
    assert sched.run(sched.store.cycles.replay_log(model, 0)) == []
    assert raw.ttl(keys.job(first[1])) > 0, "snapshotted: the result now expires"
    assert sorted(p.name for p in (tmp_path / "state" / model).iterdir()) == ["seq-2"]

    sched.clock.recovery.cadence.interval_s = NEVER
    _train(sched, model, 3)  # in the log again, on top of the snapshot at seq 2
    _durable(sched)
    assert sched.run(sched.store.cycles.progress(model)) == (5, 2)
    _crash_and_check(started, sched, url, tmp_path, model, seed=3)


def test_a_run_leaving_the_engine_takes_its_snapshot_with_it(
    started: list[Scheduler], url: str, tmp_path: Path
) -> None:
    sched = _start(started, url, tmp_path, NEVER)
    session = sched.stub.CreateSession(pb.CreateSessionRequest(owner=OWNER)).session_id
    model = _create(sched, session, 0, seed=4)
    _train(sched, model, 1)
    _train(sched, model, 3)
    resident = sched.clock.recovery.resident
    resident.end([model])  # its session ended: freed at the next cycle boundary
    sched.tick()
    assert not sched.trainer.has_model(model)
    _durable(sched)
    assert sched.run(sched.store.cycles.progress(model)) == (5, 4)  # the last step is durable
    assert sched.run(sched.store.cycles.replay_log(model, 0)) == []
    _crash_and_check(started, sched, url, tmp_path, model, seed=4)


def test_every_step_is_snapshotted_under_paging(tmp_path: Path) -> None:
    """With --max-resident-models a page-in must stay cheap: the interval does not apply."""
    from lockstep.scheduler.cycle.recovery import Recovery

    from .arithmetic_engine import ArithmeticTrainingEngine

    engine = ArithmeticTrainingEngine(tmp_path)
    paged = Recovery(None, engine, tmp_path, max_resident=2, snapshot_interval_s=NEVER)  # type: ignore[arg-type]
    unpaged = Recovery(None, engine, tmp_path, snapshot_interval_s=NEVER)  # type: ignore[arg-type]
    for d in (paged, unpaged):
        d.cadence.taken("m")
    assert paged.cadence.due("m") and not unpaged.cadence.due("m")
