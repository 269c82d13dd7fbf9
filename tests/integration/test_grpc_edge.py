"""The scheduler's gRPC edge: one servicer composed of role objects under one error mapping. An
audit entry that cannot be written after its action took effect fails nothing: the job stands,
the failure is logged and counted. The real scheduler in-process on a real Redis, with FAKE
engines."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path

import grpc
import pytest
import redis

from lockstep.observability import metrics
from lockstep.scheduler.api.servicer import RPCS, Handler, servicer
from lockstep.scheduler.state import keys
from lockstep.v1 import scheduler_pb2 as pb

from .inprocess import OWNER, Scheduler

AUDIT_ERRORS = {"component": "scheduler", "category": "audit"}


@pytest.fixture()
def url(redis_url: str) -> str:
    url = redis_url.rsplit("/", 1)[0] + "/11"  # a database of its own on the shared server
    redis.Redis.from_url(url).flushdb()
    return url


@pytest.fixture()
def sched(url: str, tmp_path: Path) -> Iterator[Scheduler]:
    s = Scheduler(url, tmp_path)
    yield s
    s.close()


def _audit_failures() -> float:
    return metrics.SCHEDULER.get_sample_value("lockstep_errors_total", AUDIT_ERRORS) or 0.0


def test_a_failed_audit_write_after_queueing_does_not_fail_the_submit(
    sched: Scheduler, url: str
) -> None:
    session = sched.stub.CreateSession(pb.CreateSessionRequest(owner=OWNER)).session_id
    # The owner's audit stream is now a plain string: every XADD to it fails (WRONGTYPE).
    r = redis.Redis.from_url(url)
    r.delete(keys.audit(OWNER))
    r.set(keys.audit(OWNER), b"not a stream")
    before = _audit_failures()
    create = pb.CreateModel(
        session_id=session,
        model_seq_id=0,
        base_model="Fake/arithmetic",
        lora_config=pb.LoraConfig(rank=1, seed=0, train_mlp=True),
    )
    reply = sched.stub.Submit(pb.SubmitRequest(owner=OWNER, create_model=create))
    assert reply.request_id and reply.model_id == f"{session}:train:0"
    assert _audit_failures() == before + 1
    sched.tick()
    done = sched.stub.RetrieveFuture(
        pb.RetrieveFutureRequest(owner=OWNER, request_id=reply.request_id)
    )
    assert done.WhichOneof("state") == "result"
    assert done.result.create_model.model_id == reply.model_id
    # A retry finds the same job (it was queued once), and the scheduler keeps serving.
    again = sched.stub.Submit(pb.SubmitRequest(owner=OWNER, create_model=create))
    assert again.request_id == reply.request_id
    # Without the fault the next action's entry is written again.
    r.delete(keys.audit(OWNER))
    sched.stub.FinishSession(pb.SessionRef(owner=OWNER, session_id=session))
    log = sched.stub.AuditLog(pb.AuditLogRequest(owner=OWNER, start=0, end=2e9))
    assert [e.event for e in log.entries] == ["session_finished"]


def test_domain_errors_map_to_status_codes_on_every_role(sched: Scheduler) -> None:
    # One mapping for every role: a catalog read, a futures call, an audited tenancy call.
    calls = (
        lambda: sched.stub.GetSession(pb.SessionRef(owner=OWNER, session_id="sess-nope")),
        lambda: sched.stub.CancelFuture(pb.CancelFutureRequest(owner=OWNER, request_id="nope")),
        lambda: sched.stub.DeleteCheckpoint(
            pb.CheckpointRef(owner=OWNER, tinker_path="tinker://sess-x:train:0/weights/a")
        ),
    )
    for call in calls:
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as err:
        sched.stub.Submit(pb.SubmitRequest(owner=OWNER))  # no op at all
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


class _Role:
    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names

    def rpcs(self) -> Mapping[str, Handler]:
        async def handler(request: object) -> object:
            return request

        return dict.fromkeys(self.names, handler)


def test_every_rpc_has_exactly_one_role() -> None:
    servicer(_Role(RPCS))  # complete: builds
    with pytest.raises(ValueError, match="no role serves"):
        servicer(_Role(RPCS[1:]))
    with pytest.raises(ValueError, match="two roles"):
        servicer(_Role(RPCS), _Role(RPCS[:1]))
    with pytest.raises(ValueError, match="the proto lacks"):
        servicer(_Role((*RPCS, "Nope")))
