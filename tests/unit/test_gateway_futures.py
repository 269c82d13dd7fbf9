"""`retrieve_future` answers and gRPC -> HTTP error mapping, against a stand-in scheduler."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from tinker.proto import response_conv

from lockstep.gateway.deps import owner_of
from lockstep.gateway.errors import http_status_for
from lockstep.v1 import scheduler_pb2 as pb
from lockstep.wire.v1 import tinker_pb2
from tests.scheduler_standin import (
    TEST_API_KEY,
    StandInScheduler,
    gateway_client,
)

RUN = "sess-1:train:0"


@pytest.fixture
def api(standin: tuple[StandInScheduler, str], sched: StandInScheduler) -> Iterator[Any]:
    with gateway_client(standin[1], long_poll_seconds=3.5) as client:
        yield client


def _retrieve(api: Any, request_type: str | None = None) -> Any:
    headers = {"X-Tinker-Request-Type": request_type} if request_type else {}
    body = {"request_id": "req-1", "allow_metadata_only": True}
    return api.post("/api/v1/retrieve_future", json=body, headers=headers)


def _result(**kwargs: Any) -> pb.FutureReply:
    return pb.FutureReply(result=pb.JobResult(**kwargs))


def test_try_again_passes_the_long_poll_deadline(api: Any, sched: StandInScheduler) -> None:
    sched.replies["RetrieveFuture"] = pb.FutureReply(
        try_again=pb.TryAgain(queue_state="paused_capacity")
    )
    r = _retrieve(api)
    assert r.status_code == 200
    assert r.json()["type"] == "try_again"
    assert (r.json()["request_id"], r.json()["queue_state"]) == ("req-1", "paused_capacity")
    req = sched.last("RetrieveFuture")
    assert (req.owner, req.request_id, req.timeout_seconds) == (
        owner_of(TEST_API_KEY),
        "req-1",
        3.5,
    )
    sched.replies["RetrieveFuture"] = pb.FutureReply(try_again=pb.TryAgain(queue_state="odd"))
    assert _retrieve(api).json()["queue_state"] == "active"


@pytest.mark.parametrize(
    "code, expected",
    [
        (grpc.StatusCode.RESOURCE_EXHAUSTED, "paused_capacity"),
        (grpc.StatusCode.DEADLINE_EXCEEDED, "active"),
    ],
)
def test_transient_scheduler_answers_become_try_again(
    api: Any, sched: StandInScheduler, code: grpc.StatusCode, expected: str
) -> None:
    sched.fail("RetrieveFuture", code, "busy")
    r = _retrieve(api)
    assert (r.status_code, r.json()["type"], r.json()["queue_state"]) == (
        200,
        "try_again",
        expected,
    )


def test_unknown_future_is_404(api: Any, sched: StandInScheduler) -> None:
    sched.fail("RetrieveFuture", grpc.StatusCode.NOT_FOUND, "no request req-1")
    r = _retrieve(api)
    assert (r.status_code, r.json()) == (404, {"detail": "no request req-1"})


def test_failed_future(api: Any, sched: StandInScheduler) -> None:
    sched.replies["RetrieveFuture"] = pb.FutureReply(
        error=pb.JobError(message="data[0].loss_fn_inputs.weights: wrong length", category="user")
    )
    assert _retrieve(api).json() == {
        "error": "data[0].loss_fn_inputs.weights: wrong length",
        "category": "user",
    }
    sched.replies["RetrieveFuture"] = pb.FutureReply(error=pb.JobError(message="x", category="?"))
    assert _retrieve(api).json()["category"] == "unknown"


def test_forward_backward_result_is_protobuf(api: Any, sched: StandInScheduler) -> None:
    out = tinker_pb2.ForwardBackwardOutput(
        loss_fn_output_type="ArrayRecord", metrics={"loss:sum": 1.5}
    )
    record = out.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=1)
    record.fields["logprobs"].CopyFrom(
        tinker_pb2.BatchedTensor(
            data=b"\0" * 8,
            offsets=(0).to_bytes(8, "little") + (8).to_bytes(8, "little"),
            dtype=tinker_pb2.DTYPE_FLOAT32,
        )
    )
    sched.replies["RetrieveFuture"] = _result(forward_backward=out)
    r = _retrieve(api, "ForwardBackward")
    assert r.headers["content-type"] == "application/x-protobuf"
    decoded = response_conv.deserialize_forward_backward_output(r.content)
    assert decoded.metrics == {"loss:sum": 1.5}
    assert decoded.loss_fn_outputs[0]["logprobs"].tolist() == [0.0, 0.0]


def test_sample_result_is_protobuf(api: Any, sched: StandInScheduler) -> None:
    resp = tinker_pb2.SampleResponse()
    resp.sequences.add(stop_reason=tinker_pb2.STOP_REASON_STOP, tokens=b"\1\0\0\0")
    sched.replies["RetrieveFuture"] = _result(sample=resp)
    r = _retrieve(api, "Sample")
    assert r.headers["content-type"] == "application/x-protobuf"
    assert response_conv.deserialize_sample_response(r.content).sequences[0].tokens == [1]


@pytest.mark.parametrize(
    "result, request_type, expected",
    [
        (
            {"create_model": pb.CreateModelResult(model_id=RUN)},
            "CreateModel",
            {"type": "create_model", "model_id": RUN},
        ),
        (
            {"optim_step": pb.OptimStepResult(metrics={"grad_norm:mean": 0.5})},
            "OptimStep",
            {"metrics": {"grad_norm:mean": 0.5}},
        ),
        (
            {"save": pb.SaveResult(path=f"tinker://{RUN}/weights/c1")},
            "SaveWeights",
            {"type": "save_weights", "path": f"tinker://{RUN}/weights/c1"},
        ),
        (
            {"save": pb.SaveResult(path=f"tinker://{RUN}/sampler_weights/s0")},
            None,
            {
                "type": "save_weights_for_sampler",
                "path": f"tinker://{RUN}/sampler_weights/s0",
                "sampling_session_id": None,
            },
        ),
        (
            {"save": pb.SaveResult(sampling_session_id="sess-1:sample:0")},
            "SaveWeightsForSampler",
            {
                "type": "save_weights_for_sampler",
                "path": None,
                "sampling_session_id": "sess-1:sample:0",
            },
        ),
        (
            {"save": pb.SaveResult(path=f"tinker://{RUN}/external_weights/e", size_bytes=100)},
            None,
            {
                "type": "save_weights_external",
                "path": f"tinker://{RUN}/external_weights/e",
                "size_bytes": 100,
            },
        ),
        (
            {"load": pb.LoadResult(model_id="sess-1:train:1", path=f"tinker://{RUN}/weights/c1")},
            "LoadWeights",
            {
                "type": "load_weights",
                "path": f"tinker://{RUN}/weights/c1",
                "model_id": "sess-1:train:1",
            },
        ),
    ],
)
def test_json_results(
    api: Any,
    sched: StandInScheduler,
    result: dict[str, Any],
    request_type: str | None,
    expected: dict[str, Any],
) -> None:
    sched.replies["RetrieveFuture"] = _result(**result)
    r = _retrieve(api, request_type)
    assert r.headers["content-type"] == "application/json"
    assert r.json() == expected


def test_empty_reply_is_a_server_failure(api: Any, sched: StandInScheduler) -> None:
    sched.replies["RetrieveFuture"] = pb.FutureReply()
    assert _retrieve(api).json()["category"] == "server"


# ---------------------------------------------------------------- error mapping
@pytest.mark.parametrize(
    "code, status",
    [
        (grpc.StatusCode.INVALID_ARGUMENT, 400),
        (grpc.StatusCode.FAILED_PRECONDITION, 400),
        (grpc.StatusCode.ALREADY_EXISTS, 400),
        (grpc.StatusCode.UNIMPLEMENTED, 400),
        (grpc.StatusCode.NOT_FOUND, 404),
        (grpc.StatusCode.PERMISSION_DENIED, 404),
        (grpc.StatusCode.UNAUTHENTICATED, 401),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
        (grpc.StatusCode.UNAVAILABLE, 503),
        (grpc.StatusCode.INTERNAL, 500),
    ],
)
def test_grpc_status_mapping(code: grpc.StatusCode, status: int) -> None:
    assert http_status_for(code) == status


def test_permanent_errors_are_never_retryable_statuses() -> None:
    for code in (
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.UNIMPLEMENTED,
    ):
        assert http_status_for(code) not in (408, 409, 429) and http_status_for(code) < 500


@pytest.mark.parametrize(
    "code, details, status, detail",
    [
        (
            grpc.StatusCode.INVALID_ARGUMENT,
            "prompt: token 99999 outside the vocabulary",
            400,
            "prompt: token 99999 outside the vocabulary",
        ),
        (grpc.StatusCode.PERMISSION_DENIED, "model belongs to owner abc", 404, "not found"),
        (grpc.StatusCode.UNAVAILABLE, "redis down", 503, "scheduler unavailable: redis down"),
        (
            grpc.StatusCode.ALREADY_EXISTS,
            "checkpoint ckpt-1 exists",
            400,
            "checkpoint ckpt-1 exists",
        ),
    ],
)
def test_route_errors_carry_the_scheduler_message(
    api: Any,
    sched: StandInScheduler,
    code: grpc.StatusCode,
    details: str,
    status: int,
    detail: str,
) -> None:
    sched.fail("Submit", code, details)
    body = {"model_id": RUN, "seq_id": 1, "path": "ckpt-1"}
    r = api.post("/api/v1/save_weights", json=body)
    assert (r.status_code, r.json()) == (status, {"detail": detail})


def test_unreachable_scheduler_is_503_everywhere() -> None:
    with gateway_client("127.0.0.1:1") as client:
        submit = client.post("/api/v1/create_session", json={"tags": [], "sdk_version": "x"})
        poll = client.post("/api/v1/retrieve_future", json={"request_id": "req-1"})
    assert submit.status_code == 503 and submit.json()["detail"].startswith("scheduler unavailable")
    assert poll.status_code == 503
