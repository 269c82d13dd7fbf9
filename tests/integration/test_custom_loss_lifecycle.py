"""A stored custom loss lives as long as its session and counts in usage; the cost bound a
loss must keep is reported with the model's info and the server's capabilities. The real
scheduler in-process on a real Redis (its engines are the arithmetic FAKES: a custom loss is
checked, priced and stored by the scheduler alone, so the fake trainer here says it takes custom
losses; none ever reaches it)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import grpc
import pytest
from tinker.lib.public_interfaces.custom_loss import encode_graph, trace_loss

from lockstep.custom_loss.bound import FLOOR_FLOPS_PER_TOKEN, UNLIMITED_MEMORY_BYTES, CostBound
from lockstep.engine.capabilities import TrainerCapabilities
from lockstep.engine.types import NO_MEMORY_LIMIT
from lockstep.scheduler.state import custom_losses
from lockstep.v1 import scheduler_pb2 as pb

from .arithmetic_engine import ArithmeticTrainingEngine
from .inprocess import OWNER, Scheduler
from .test_cycle_commit import _create, started, url  # noqa: F401


class StoringTrainer(ArithmeticTrainingEngine):
    """The arithmetic FAKE declaring server-side custom losses, so create_custom_loss is
    admitted; these tests only create, store and delete losses (no pass runs one)."""

    def capabilities(self) -> TrainerCapabilities:
        return TrainerCapabilities("arithmetic", custom_loss=True)


def _start(started: list[Scheduler], url: str, data: Path) -> Scheduler:  # noqa: F811
    sched = Scheduler(url, data, trainer=StoringTrainer(data))
    started.append(sched)
    return sched


def weighted(logprobs, weights):  # type: ignore[no-untyped-def]
    return -(logprobs * weights).sum(), {}


def _create_loss(sched: Scheduler, session: str, seq: int) -> str:
    handle = trace_loss(weighted, {"logprobs": 1, "weights": 1}, session)
    req = pb.CreateCustomLossRequest(
        owner=OWNER,
        session_id=session,
        custom_loss_seq_id=seq,
        name=handle.name,
        inputs=[pb.CustomLossInput(name=x.name, rank=x.rank) for x in handle.inputs],
        graph_json=encode_graph(handle).model_dump_json().encode(),
    )
    rid = sched.stub.CreateCustomLoss(req).request_id
    reply = sched.stub.RetrieveFuture(pb.RetrieveFutureRequest(owner=OWNER, request_id=rid))
    return reply.result.custom_loss.loss_id


def test_losses_leave_with_their_session_and_count_in_usage(
    started: list[Scheduler],  # noqa: F811
    url: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    sched = _start(started, url, tmp_path)
    session = sched.stub.CreateSession(pb.CreateSessionRequest(owner=OWNER)).session_id
    ids = {_create_loss(sched, session, seq) for seq in (0, 1, 1)}  # the last is a retry
    assert len(ids) == 2
    now = time.time()
    usage = sched.stub.Usage(pb.UsageRequest(owner=OWNER, start=now - 60, end=now + 60))
    assert sum(b.custom_losses for b in usage.buckets if b.session_id == session) == 2
    audit = sched.stub.AuditLog(pb.AuditLogRequest(owner=OWNER, start=now - 60, end=now + 60))
    created = [
        json.loads(e.details_json) for e in audit.entries if e.event == "custom_loss_created"
    ]
    assert {d["loss_id"] for d in created} == ids

    sched.stub.FinishSession(pb.SessionRef(owner=OWNER, session_id=session))
    for loss_id in ids:
        assert sched.run(custom_losses.record(sched.store, loss_id)) is None
    ended = [
        e
        for e in sched.stub.AuditLog(
            pb.AuditLogRequest(owner=OWNER, start=now - 60, end=time.time() + 60)
        ).entries
        if e.event == "session_finished"
    ]
    assert json.loads(ended[-1].details_json)["custom_losses"] == 2
    with pytest.raises(grpc.RpcError):  # the session is over: no new loss, no use of an old one
        _create_loss(sched, session, 2)


def test_the_cost_bound_is_reported(
    started: list[Scheduler],  # noqa: F811
    url: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    sched = _start(started, url, tmp_path)
    # The FAKE model has no config.json and its trainer no memory budget: the floor, and the
    # bound for an unlimited trainer.
    bound = CostBound.of(0, NO_MEMORY_LIMIT)
    assert bound.memory_bytes == UNLIMITED_MEMORY_BYTES
    caps = sched.stub.GetServerCapabilities(pb.CapabilitiesRequest()).models[0]
    assert caps.custom_loss_max_flops_per_token == bound.flops_per_token == FLOOR_FLOPS_PER_TOKEN
    assert caps.custom_loss_max_memory_bytes == bound.memory_bytes > 0
    session = sched.stub.CreateSession(pb.CreateSessionRequest(owner=OWNER)).session_id
    model = _create(sched, session, 0, seed=1)
    info = sched.stub.GetModelInfo(pb.ModelRef(owner=OWNER, model_id=model))
    assert info.custom_loss_max_flops_per_token == bound.flops_per_token
    assert info.custom_loss_max_memory_bytes == bound.memory_bytes
