"""`retrieve_futures`, `cancel_future`, `join_sampling_session` and the client-config knobs,
against a stand-in scheduler: what the gateway asks, and how it shapes the SDK's answers."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from tinker.proto import response_conv
from tinker.types.futures_retrieve_response import FuturesRetrieveResponse
from tinker.types.join_sampling_session_response import JoinSamplingSessionResponse

from lockstep.gateway.deps import owner_of
from lockstep.v1 import scheduler_pb2 as pb
from lockstep.wire.v1 import tinker_pb2
from tests.scheduler_standin import (
    TEST_API_KEY,
    StandInScheduler,
    gateway_client,
)

SAMPLER = "sess-1:sample:0"
LONG_POLL = 3.5


@pytest.fixture
def api(standin: tuple[StandInScheduler, str], sched: StandInScheduler) -> Iterator[Any]:
    with gateway_client(standin[1], long_poll_seconds=LONG_POLL) as client:
        yield client


def _poll(api: Any, **body: Any) -> Any:
    target = {"type": "sampling_session", "sampling_session_id": SAMPLER, "cloned_sampler_id": 2}
    return api.post("/api/v1/retrieve_futures", json={"target": target, **body})


def test_retrieve_futures_asks_for_the_clone_and_shapes_the_sdk_answer(
    api: Any, sched: StandInScheduler
) -> None:
    sched.replies["RetrieveFutures"] = pb.RetrieveFuturesReply(
        completions=[
            pb.FutureCompletion(request_id="req-a", payload_size=136),
            pb.FutureCompletion(request_id="req-b", failed=True),
        ],
        cursor=7,
    )
    answer = _poll(api, prev_cursor=5, retrieved_request_ids=["req-0"])
    assert answer.status_code == 200, answer.text
    assert answer.json() == {
        "completions": [
            {"state": "finished", "request_id": "req-a", "response_payload_uncompressed_size": 136},
            {"state": "failed", "request_id": "req-b"},
        ],
        "cursor": 7,
    }
    parsed = FuturesRetrieveResponse.model_validate(answer.json())  # the SDK's own model
    assert [c.state for c in parsed.completions] == ["finished", "failed"]
    req = sched.last("RetrieveFutures")
    assert (req.owner, req.sampler_id, req.clone, req.prev_cursor, req.timeout_seconds) == (
        owner_of(TEST_API_KEY),
        SAMPLER,
        2,
        5,
        LONG_POLL,  # no timeout: the gateway's long-poll
    )


def test_answers_a_poll_brought_along_are_served_once(api: Any, sched: StandInScheduler) -> None:
    """A completion sent with its answer: the SDK's retrieve_future that follows is answered
    by the gateway (no scheduler call), once; a second fetch, or a completion sent without
    its answer (past the poll's prefetch budget), asks the scheduler."""
    sample = tinker_pb2.SampleResponse()
    sample.sequences.add(stop_reason=tinker_pb2.STOP_REASON_STOP, tokens=b"\7\0\0\0")
    failure = pb.JobError(message="engine said no", category="user")
    sched.replies["RetrieveFutures"] = pb.RetrieveFuturesReply(
        completions=[
            pb.FutureCompletion(
                request_id="req-a",
                payload_size=sample.ByteSize(),
                answer=pb.FutureReply(result=pb.JobResult(sample=sample)),
            ),
            pb.FutureCompletion(
                request_id="req-b", failed=True, answer=pb.FutureReply(error=failure)
            ),
            pb.FutureCompletion(request_id="req-c", payload_size=9),  # past the budget
        ],
        cursor=3,
    )
    assert _poll(api, prev_cursor=0).json()["cursor"] == 3
    sched.replies["RetrieveFuture"] = pb.FutureReply(
        error=pb.JobError(message="asked the scheduler", category="user")
    )

    def fetch(rid: str) -> Any:
        headers = {"X-Tinker-Request-Type": "Sample"}
        return api.post("/api/v1/retrieve_future", json={"request_id": rid}, headers=headers)

    first = fetch("req-a")
    assert first.status_code == 200, first.text
    assert response_conv.deserialize_sample_response(first.content).sequences[0].tokens == [7]
    assert "engine said no" in fetch("req-b").text
    assert sched.requests("RetrieveFuture") == []  # both answered by the gateway
    assert "asked the scheduler" in fetch("req-a").text  # served once: then the scheduler
    assert "asked the scheduler" in fetch("req-c").text
    assert [r.request_id for r in sched.requests("RetrieveFuture")] == ["req-a", "req-c"]


@pytest.mark.parametrize(("timeout", "held"), [(0, 0.0), (1.5, 1.5), (600, LONG_POLL)])
def test_retrieve_futures_holds_at_most_the_long_poll(
    api: Any, sched: StandInScheduler, timeout: float, held: float
) -> None:
    assert _poll(api, timeout=timeout).status_code == 200
    assert sched.last("RetrieveFutures").timeout_seconds == held


def test_retrieve_futures_with_nothing_new_answers_the_same_cursor(
    api: Any, sched: StandInScheduler
) -> None:
    sched.fail("RetrieveFutures", grpc.StatusCode.DEADLINE_EXCEEDED, "slow")
    answer = _poll(api, prev_cursor=9)
    assert answer.json() == {"completions": [], "cursor": 9}


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"target": {"type": "training_run", "sampling_session_id": SAMPLER}}, "target.type"),
        ({"target": {"sampling_session_id": SAMPLER, "cloned_sampler_id": -1}}, "cloned"),
        ({"target": {"sampling_session_id": SAMPLER}, "prev_cursor": -1}, "prev_cursor"),
        ({"target": {"sampling_session_id": SAMPLER}, "timeout": -1}, "timeout"),
        ({"target": {"sampling_session_id": "a b"}}, "target.sampling_session_id"),
        ({}, "target"),
    ],
)
def test_retrieve_futures_refuses_a_bad_body_by_field(
    api: Any, sched: StandInScheduler, body: dict[str, Any], field: str
) -> None:
    answer = api.post("/api/v1/retrieve_futures", json=body)
    assert answer.status_code == 400, answer.text
    assert field in answer.json()["detail"]
    assert not sched.requests("RetrieveFutures")


def test_retrieve_futures_passes_the_schedulers_refusals_on(
    api: Any, sched: StandInScheduler
) -> None:
    sched.fail("RetrieveFutures", grpc.StatusCode.NOT_FOUND, f"sampler {SAMPLER} does not exist")
    missing = _poll(api)
    assert missing.status_code == 404 and SAMPLER in missing.json()["detail"]
    sched.fail("RetrieveFutures", grpc.StatusCode.INVALID_ARGUMENT, "prev_cursor: 9 is past")
    assert _poll(api, prev_cursor=9).status_code == 400


@pytest.mark.parametrize(
    ("outcome", "word"),
    [
        (pb.CANCEL_OUTCOME_CANCELLED, "cancelled"),
        (pb.CANCEL_OUTCOME_ALREADY_FINISHED, "already_finished"),
        (pb.CANCEL_OUTCOME_ALREADY_FAILED, "already_failed"),
    ],
)
def test_cancel_future_says_what_it_did(
    api: Any, sched: StandInScheduler, outcome: int, word: str
) -> None:
    sched.replies["CancelFuture"] = pb.CancelFutureReply(outcome=outcome)
    answer = api.post("/api/v1/cancel_future", json={"request_id": "req-1"})
    assert answer.json() == {"request_id": "req-1", "outcome": word}
    req = sched.last("CancelFuture")
    assert (req.owner, req.request_id) == (owner_of(TEST_API_KEY), "req-1")


def test_cancel_future_refusals(api: Any, sched: StandInScheduler) -> None:
    assert api.post("/api/v1/cancel_future", json={}).status_code == 400
    bad = api.post("/api/v1/cancel_future", json={"request_id": "../x"})
    assert bad.status_code == 400 and "request_id" in bad.json()["detail"]
    sched.fail("CancelFuture", grpc.StatusCode.NOT_FOUND, "request req-9 does not exist")
    missing = api.post("/api/v1/cancel_future", json={"request_id": "req-9"})
    assert missing.status_code == 404 and "req-9" in missing.json()["detail"]


def test_join_sampling_session(api: Any, sched: StandInScheduler) -> None:
    sched.replies["JoinSamplingSession"] = pb.JoinSamplingSessionReply(client_counter=3)
    answer = api.post(
        "/api/v1/join_sampling_session",
        json={"sampling_session_id": SAMPLER, "type": "join_sampling_session"},
    )
    assert answer.json() == {"type": "join_sampling_session", "client_counter": 3}
    assert JoinSamplingSessionResponse.model_validate(answer.json()).client_counter == 3
    assert sched.last("JoinSamplingSession").sampler_id == SAMPLER


def test_client_config_follows_the_settings(standin: tuple[StandInScheduler, str]) -> None:
    with gateway_client(
        standin[1], proto_compress_fwdbwd=True, sample_session_polling=False
    ) as client:
        config = client.post("/api/v1/client/config", json={"sdk_version": "0.38.0"}).json()
    assert config["proto_compress_fwdbwd"] is True
    assert config["sample_use_retrieve_futures"] is False
