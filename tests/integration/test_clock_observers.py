"""The clock's observers (scheduler/observers/observers.py): every hook is called once per
phase, in order, on a working cycle, an idle one and one the engine's death abandons; and the
built-in metrics observer reports that death. The real scheduler in-process on a real Redis,
FAKE engines."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
import redis

from lockstep.observability import metrics
from lockstep.scheduler.observers.observers import CycleFailure, CycleObserver
from lockstep.scheduler.planner import CyclePlan
from lockstep.scheduler.state.outcome import Outcome
from lockstep.scheduler.state.records import QueuedOp
from lockstep.v1 import scheduler_pb2 as pb

from .inprocess import OWNER, Scheduler, fb

TOKENS = [3, 9, 27, 17, 51]


class Recorder(CycleObserver):
    """A test observer: writes down each hook it is called with."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.outcomes: dict[str, Outcome] = {}

    async def begun(self) -> None:
        self.calls.append("begun")

    async def planned(
        self, queues: Mapping[str, list[QueuedOp]], plan: CyclePlan, runs: bool
    ) -> None:
        self.calls.append(f"planned runs={runs}")

    async def dispatching(self, cycle: int, plan: CyclePlan) -> None:
        self.calls.append("dispatching")

    async def dispatched(self, plan: CyclePlan, outcomes: Mapping[str, Outcome]) -> None:
        self.calls.append("dispatched")

    async def finished(self, plan: CyclePlan, outcomes: Mapping[str, Outcome]) -> None:
        self.calls.append("finished")
        self.outcomes = dict(outcomes)

    async def failed(self, why: CycleFailure) -> None:
        self.calls.append(f"failed {why}")


WORKING = ["begun", "planned runs=True", "dispatching", "dispatched", "finished"]


@pytest.fixture()
def sched(redis_url: str, tmp_path: Path) -> Iterator[Scheduler]:
    url = redis_url.rsplit("/", 1)[0] + "/10"  # a database of its own on the shared server
    redis.Redis.from_url(url).flushdb()
    scheduler = Scheduler(url, tmp_path)
    yield scheduler
    scheduler.close()


def _model(sched: Scheduler) -> str:
    session = sched.stub.CreateSession(pb.CreateSessionRequest(owner=OWNER)).session_id
    create = pb.CreateModel(
        session_id=session,
        model_seq_id=0,
        base_model="Fake/arithmetic",
        lora_config=pb.LoraConfig(rank=1, seed=1, train_mlp=True),
    )
    sched.stub.Submit(pb.SubmitRequest(owner=OWNER, create_model=create))
    sched.tick()
    return f"{session}:train:0"


def test_each_hook_runs_once_per_phase(sched: Scheduler) -> None:
    model = _model(sched)
    recorder = Recorder()
    sched.clock.observers.all.append(recorder)

    rid = sched.stub.Submit(fb(model, 1, TOKENS)).request_id
    sched.tick()
    assert recorder.calls == WORKING
    assert recorder.outcomes[rid].error is None  # finished sees the committed outcome

    recorder.calls.clear()
    sched.tick()  # nothing queued: a triggered clock plans and stops there
    assert recorder.calls == ["begun", "planned runs=False"]


def test_an_engine_death_is_a_failed_cycle_then_the_work_runs_again(sched: Scheduler) -> None:
    model = _model(sched)
    recorder = Recorder()
    sched.clock.observers.all.append(recorder)
    engine_errors = metrics.SCHEDULER.get_sample_value(
        "lockstep_errors_total", {"component": "scheduler", "category": "engine"}
    )

    rid = sched.stub.Submit(fb(model, 1, TOKENS)).request_id
    sched.trainer.die_at_next_pass = True
    sched.tick()
    assert recorder.calls == ["begun", "planned runs=True", "dispatching", "failed engine"]
    after = metrics.SCHEDULER.get_sample_value(
        "lockstep_errors_total", {"component": "scheduler", "category": "engine"}
    )
    assert (after or 0.0) - (engine_errors or 0.0) == 1

    recorder.calls.clear()
    sched.tick()  # the restarted engine runs the same work
    assert recorder.calls == WORKING
    assert recorder.outcomes[rid].error is None
