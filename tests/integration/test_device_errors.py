"""A device error inside an engine call (a CUDA device-side assert) is an engine death: the
engine's child process exits instead of serving another call on its broken context, the
scheduler restarts it and its poison hunt refuses the request that does it every time, and the
other tenants' numbers equal an undisturbed run. The real scheduler in-process on a real Redis,
the real child process host (`ProcessTrainingEngine`), and a FAULT-INJECTING arithmetic engine
in it that raises torch's own `AcceleratorError` (`device_fault_engine.py`): no GPU here."""

from __future__ import annotations

import functools
import math
from pathlib import Path

import pytest

from lockstep.v1 import scheduler_pb2 as pb
from lockstep.workers.process import ProcessTrainingEngine

from .arithmetic_engine import features, initial_weights
from .device_fault_engine import DeviceFaultEngine
from .inprocess import OWNER, Scheduler, fb
from .test_cycle_commit import LR, _create, _result, _step, started, url  # noqa: F401

POISON = 61
GOOD = [[3, 9, 27, 17, 51], [5, 10, 20, 40], [7, 14, 28, 56, 12, 24]]


def test_a_device_error_restarts_the_engine_and_its_request_is_refused(
    started: list[Scheduler],  # noqa: F811
    url: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    engine = ProcessTrainingEngine(functools.partial(DeviceFaultEngine, tmp_path, POISON))
    sched = Scheduler(url, tmp_path, trainer=engine)
    started.append(sched)
    first_pid = engine.process.pid
    session = sched.stub.CreateSession(pb.CreateSessionRequest(owner=OWNER)).session_id
    models = [_create(sched, session, i, seed=10 + i) for i in range(len(GOOD) + 1)]
    rows = [*GOOD, [POISON, 2, 4, 8]]
    rids = [
        [sched.stub.Submit(req).request_id for req in (fb(m, 1, r), _step(m, 2), fb(m, 3, r, True))]
        for m, r in zip(models, rows, strict=True)
    ]
    replies = [[_result(sched, rid, cycles=30) for rid in ids] for ids in rids]

    # Each death was a process exit: never a second call on a context that raised one.
    assert engine.process.restarts >= 2 and engine.process.pid != first_pid
    incidents = 2  # the poisoned tenant's two passes (seq 1 and 3) each break the device
    assert engine.process.restarts <= incidents * (2 + math.ceil(math.log2(len(models))))
    *good, poisoned = replies
    for reply in (poisoned[0], poisoned[2]):
        assert reply.WhichOneof("state") == "error" and reply.error.category == "user"
        assert "crashed the training engine" in reply.error.message
        assert "device error" in reply.error.message
        assert "device-side assert" in reply.error.message
    for i, (fb1, step, fb3) in enumerate(good):
        assert [r.WhichOneof("state") for r in (fb1, step, fb3)] == ["result"] * 3, i
        f = features([GOOD[i]])
        w1 = initial_weights(10 + i) - LR * f  # exactly one pass and one step applied
        loss = fb3.result.forward_backward.metrics["loss:sum"]
        assert loss == pytest.approx(float(w1 @ f), rel=1e-12)
    engine.close()
