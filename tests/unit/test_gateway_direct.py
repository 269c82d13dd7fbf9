"""The hot routes served directly (`lockstep/gateway/direct.py`) answer exactly as FastAPI's own
routes do: every case below goes to a gateway with the direct routes and to one without, and
the two answers (status, headers, body bytes) and the scheduler calls they made must match."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest

from lockstep.gateway import direct
from lockstep.v1 import scheduler_pb2 as pb
from tests.scheduler_standin import StandInScheduler, gateway_client
from tests.unit.test_gateway_routes import FB_JSON, MODEL, _fwd_bwd
from tests.unit.test_gateway_sampling import _sample

HOT = direct.HOT_PATHS
JSON = {"Content-Type": "application/json"}
PROTO = {"Content-Type": "application/x-protobuf"}
OPTIM = {"model_id": MODEL, "seq_id": 4, "adam_params": {"learning_rate": 0.001}}
FUTURES = {"target": {"sampling_session_id": "sess-1:sample:0"}, "prev_cursor": 0, "timeout": 0.1}
RESULT = pb.FutureReply(result=pb.JobResult(optim_step=pb.OptimStepResult()))

Setup = Callable[[StandInScheduler], None]


def _nothing(sched: StandInScheduler) -> None:
    pass


def _reply(method: str, message: Any) -> Setup:
    def setup(sched: StandInScheduler) -> None:
        sched.replies[method] = message

    return setup


def _fail(method: str, code: grpc.StatusCode) -> Setup:
    def setup(sched: StandInScheduler) -> None:
        sched.fail(method, code, "told so")

    return setup


# (path, request keyword arguments, scheduler set-up)
CASES: dict[str, tuple[str, dict[str, Any], Setup]] = {
    "fb protobuf": (
        "/api/v1/forward_backward",
        {"content": _fwd_bwd(), "headers": PROTO},
        _nothing,
    ),
    "fb json": ("/api/v1/forward_backward", {"json": FB_JSON}, _nothing),
    "fb bad protobuf": (
        "/api/v1/forward_backward",
        {"content": b"\x0a\xff", "headers": PROTO},
        _nothing,
    ),
    "fb bad json": (
        "/api/v1/forward_backward",
        {"json": {**FB_JSON, "forward_input": {"data": "x"}}},
        _nothing,
    ),
    "fb refused by the scheduler": (
        "/api/v1/forward_backward",
        {"content": _fwd_bwd(), "headers": PROTO},
        _fail("Submit", grpc.StatusCode.INVALID_ARGUMENT),
    ),
    "fb no key": (
        "/api/v1/forward_backward",
        {"content": _fwd_bwd(), "headers": {**PROTO, "X-API-Key": ""}},
        _nothing,
    ),
    "optim": ("/api/v1/optim_step", {"json": OPTIM}, _nothing),
    "optim invalid": ("/api/v1/optim_step", {"json": {**OPTIM, "seq_id": 0}}, _nothing),
    "optim not json": ("/api/v1/optim_step", {"content": b"{", "headers": JSON}, _nothing),
    "optim text": (
        "/api/v1/optim_step",
        {"content": b'{"a": 1}', "headers": {"Content-Type": "text/plain"}},
        _nothing,
    ),
    "optim empty": ("/api/v1/optim_step", {"content": b"", "headers": JSON}, _nothing),
    "optim bad key": (
        "/api/v1/optim_step",
        {"json": OPTIM, "headers": {"X-API-Key": "tml-wrong"}},
        _nothing,
    ),
    "optim busy": (
        "/api/v1/optim_step",
        {"json": OPTIM},
        _fail("Submit", grpc.StatusCode.UNAVAILABLE),
    ),
    "sample": (
        "/api/v1/asample",
        {"json": _sample()},
        _reply("Submit", pb.SubmitReply(request_id="r", sample_sequence_ids=["a", "b"])),
    ),
    "sample no session": ("/api/v1/asample", {"json": _sample(sampling_session_id=None)}, _nothing),
    "sample bad params": ("/api/v1/asample", {"json": _sample(num_samples="two")}, _nothing),
    "sample array": ("/api/v1/asample", {"json": [1]}, _nothing),
    "retrieve try again": ("/api/v1/retrieve_future", {"json": {"request_id": "req-1"}}, _nothing),
    "retrieve result": (
        "/api/v1/retrieve_future",
        {"json": {"request_id": "req-1"}, "headers": {"X-Tinker-Request-Type": "OptimStep"}},
        _reply("RetrieveFuture", RESULT),
    ),
    "retrieve bad id": ("/api/v1/retrieve_future", {"json": {"request_id": "a b"}}, _nothing),
    "retrieve missing": ("/api/v1/retrieve_future", {"json": {}}, _nothing),
    "retrieve not found": (
        "/api/v1/retrieve_future",
        {"json": {"request_id": "req-1"}},
        _fail("RetrieveFuture", grpc.StatusCode.NOT_FOUND),
    ),
    "futures": (
        "/api/v1/retrieve_futures",
        {"json": FUTURES},
        _reply(
            "RetrieveFutures",
            pb.RetrieveFuturesReply(
                completions=[pb.FutureCompletion(request_id="x", payload_size=9)], cursor=1
            ),
        ),
    ),
    "futures nothing new": (
        "/api/v1/retrieve_futures",
        {"json": FUTURES},
        _fail("RetrieveFutures", grpc.StatusCode.DEADLINE_EXCEEDED),
    ),
    "futures no target": ("/api/v1/retrieve_futures", {"json": {"prev_cursor": 0}}, _nothing),
}


@pytest.fixture(scope="module")
def clients(standin: tuple[StandInScheduler, str]) -> Iterator[tuple[Any, Any]]:
    """A gateway with its direct routes, and one that leaves every route to FastAPI."""
    with gateway_client(standin[1]) as fast:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(direct, "HOT_PATHS", ())
            with gateway_client(standin[1]) as plain:
                yield fast, plain


def _answer(client: Any, sched: StandInScheduler, case: str) -> tuple[Any, ...]:
    path, kwargs, setup = CASES[case]
    sched.reset()
    setup(sched)
    r = client.post(path, **kwargs)
    headers = {k: v for k, v in r.headers.items() if k != "date"}
    return r.status_code, headers, r.content, [(m, str(req)) for m, req in sched.calls]


@pytest.mark.parametrize("case", CASES)
def test_direct_routes_answer_as_fastapi_does(
    clients: tuple[Any, Any], sched: StandInScheduler, case: str
) -> None:
    fast, plain = clients
    assert CASES[case][0] in HOT
    assert _answer(fast, sched, case) == _answer(plain, sched, case)


def test_direct_routes_are_counted_under_their_route(
    clients: tuple[Any, Any], sched: StandInScheduler
) -> None:
    fast, _ = clients
    series = (
        "lockstep_http_request_duration_seconds_count"
        '{method="POST",route="/api/v1/optim_step",status="200"}'
    )

    def count() -> float:
        for line in fast.get("/metrics").text.splitlines():
            if line.startswith(series + " "):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    before = count()
    assert fast.post("/api/v1/optim_step", json=OPTIM).status_code == 200
    assert count() == before + 1


def _served_directly(app: Any) -> set[str]:
    return {
        p for m in app.user_middleware if m.cls is direct.DirectRoutes for p in m.kwargs["routes"]
    }


def test_the_comparison_is_between_the_two_paths(clients: tuple[Any, Any]) -> None:
    fast, plain = clients
    assert _served_directly(fast.app) == set(HOT)
    assert _served_directly(plain.app) == set()
