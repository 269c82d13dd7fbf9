"""Partners (scheduler/cycle/partners.py): models that shared the last cycle keep sharing when
one's next step reaches the scheduler a little after the other's (a busy machine), and a partner
that stopped costs the others one bounded wait, once. The real scheduler in-process on a real
Redis with the FAKE arithmetic engines; the test runs each cycle itself."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from lockstep.scheduler.cycle import partners
from lockstep.scheduler.state.records import QueuedOp
from lockstep.v1 import scheduler_pb2 as pb

from .inprocess import OWNER, Scheduler, fb
from .test_cycle_commit import _create, _result, _start, started, url  # noqa: F401

TOKENS = [3, 9, 27, 17, 51]


def cycle_of(sched: Scheduler, rid: str) -> int:
    reply = _result(sched, rid, cycles=1)
    return int(reply.result.forward_backward.metrics["clock_cycle:unique"])


def shared_cycle(sched: Scheduler, models: list[str], seq: int) -> None:
    rids = [sched.stub.Submit(fb(m, seq, TOKENS)).request_id for m in models]
    sched.tick()
    assert len({cycle_of(sched, rid) for rid in rids}) == 1


def test_a_cycle_waits_for_a_partner_whose_step_comes_late(
    started: list[Scheduler],  # noqa: F811
    url: str,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sched = _start(started, url, tmp_path)
    session = sched.stub.CreateSession(pb.CreateSessionRequest(owner=OWNER)).session_id
    a, b = _create(sched, session, 0, seed=1), _create(sched, session, 1, seed=2)
    shared_cycle(sched, [a, b], 1)  # partners from now on
    monkeypatch.setattr(partners, "MAX_WAIT_S", 600.0)  # the late step surely comes in time
    sched.clock.partners.cycle_s = 600.0
    first = sched.stub.Submit(fb(a, 2, TOKENS)).request_id
    cycle = asyncio.run_coroutine_threadsafe(sched.clock.cycle(), sched.loop)
    late = sched.stub.Submit(fb(b, 2, TOKENS)).request_id  # while the cycle waits for it
    cycle.result(timeout=600)
    assert cycle_of(sched, first) == cycle_of(sched, late)


def test_a_partner_that_stopped_costs_one_wait(
    started: list[Scheduler],  # noqa: F811
    url: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    sched = _start(started, url, tmp_path)
    session = sched.stub.CreateSession(pb.CreateSessionRequest(owner=OWNER)).session_id
    a, b = _create(sched, session, 0, seed=1), _create(sched, session, 1, seed=2)
    shared_cycle(sched, [a, b], 1)
    assert sched.clock.partners.models == {a, b}
    sched.clock.partners.cycle_s = 0.2
    rid = sched.stub.Submit(fb(a, 2, TOKENS)).request_id
    started_at = time.monotonic()
    sched.tick()  # b never comes: the cycle runs a's step after the wait
    assert time.monotonic() - started_at >= 0.2
    assert _result(sched, rid, cycles=1).WhichOneof("state") == "result"
    assert sched.clock.partners.models == frozenset()  # no more waits for b
    again = sched.stub.Submit(fb(a, 3, TOKENS)).request_id
    sched.tick()
    assert _result(sched, again, cycles=1).WhichOneof("state") == "result"


def test_a_step_that_lands_while_the_cycle_waits_for_a_partner_is_planned(
    started: list[Scheduler],  # noqa: F811
    url: str,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A submission just after the cycle read the queues (its wake-up set while the cycle
    waits for a partner that never comes) is in that cycle: its wake-up is not lost."""
    sched = _start(started, url, tmp_path)
    session = sched.stub.CreateSession(pb.CreateSessionRequest(owner=OWNER)).session_id
    c = _create(sched, session, 2, seed=3)
    a, b = _create(sched, session, 0, seed=1), _create(sched, session, 1, seed=2)
    shared_cycle(sched, [a, b], 1)
    sched.clock.partners.cycle_s = 0.2  # b never comes: the wait ends after about this
    first = sched.stub.Submit(fb(a, 2, TOKENS)).request_id
    read = sched.clock.store.cycles.queued_ops
    landed: list[str] = []

    async def read_then_one_lands() -> tuple[dict[str, list[QueuedOp]], dict[str, int]]:
        found = await read()
        if not landed:  # c's step lands (claimed, clock woken) right after the first read
            reply = await asyncio.to_thread(sched.stub.Submit, fb(c, 1, TOKENS))
            landed.append(reply.request_id)
        return found

    monkeypatch.setattr(sched.clock.store.cycles, "queued_ops", read_then_one_lands)
    sched.tick()
    assert _result(sched, first, cycles=1).WhichOneof("state") == "result"
    assert _result(sched, landed[0], cycles=1).WhichOneof("state") == "result"
