"""The hot routes served directly (`lockstep/gateway/direct.py`) answer exactly as FastAPI's own
routes do: every case below goes to a gateway with the direct routes and to one without, and
the two answers (status, headers, body bytes) and the scheduler calls they made must match."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Annotated, Any, ClassVar, cast

import grpc
import pytest
from fastapi import APIRouter, Depends, FastAPI, Header, Request, Response
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from pydantic import BaseModel

from lockstep.gateway import direct
from lockstep.gateway.body import BodyLimitMiddleware
from lockstep.gateway.errors import ApiError, install_error_handlers
from lockstep.gateway.ops import registry
from lockstep.gateway.ops.base import GatewayOp
from lockstep.v1 import scheduler_pb2 as pb
from tests.scheduler_standin import StandInScheduler, gateway_client
from tests.unit.test_gateway_routes import FB_JSON, MODEL, _fwd_bwd
from tests.unit.test_gateway_sampling import _sample

# What every training step and sample calls (forward is a forward_backward).
HOT = (
    "/api/v1/forward_backward",
    "/api/v1/optim_step",
    "/api/v1/asample",
    "/api/v1/retrieve_future",
    "/api/v1/retrieve_futures",
)
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
    with gateway_client(standin[1]) as fast, gateway_client(standin[1], direct=False) as plain:
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
        r.path
        for m in app.user_middleware
        if m.cls is direct.DirectRoutes
        for r in m.kwargs["routes"]
    }


def test_the_comparison_is_between_the_two_paths(clients: tuple[Any, Any]) -> None:
    fast, plain = clients
    assert _served_directly(fast.app) == set(HOT)
    assert _served_directly(plain.app) == set()


def _direct_layer(app: Any) -> direct.DirectRoutes:
    """The app's built DirectRoutes middleware (its `.app` is what it falls back to)."""
    layer = app.middleware_stack
    while not isinstance(layer, direct.DirectRoutes):
        layer = layer.app
    return layer


# What FastAPI answers itself: a body that is not JSON, does not parse or fails its model.
LEFT_TO_FASTAPI = {
    "optim not json",
    "optim text",
    "optim empty",
    "sample bad params",
    "sample array",
    "retrieve missing",
    "futures no target",
}


def test_the_plain_cases_are_served_directly(
    clients: tuple[Any, Any], sched: StandInScheduler, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The comparison above is only worth something if the direct layer answers the cases
    itself (errors of its dependencies and endpoints included): only a body off the plain path
    reaches FastAPI's routing."""
    fast, _ = clients
    fast.get("/metrics")  # the middleware stack is built
    layer = _direct_layer(fast.app)
    reached: list[str] = []
    monkeypatch.setattr(layer, "app", _spy(layer.app, reached))
    for case in CASES:
        reached.clear()
        _answer(fast, sched, case)
        assert bool(reached) == (case in LEFT_TO_FASTAPI), case


class _Rejected(BaseModel):
    """What the test op below answers with: not the future its response model promises."""

    request_id: int


class _RejectedAnswer(GatewayOp):
    """A hot op whose answer its own response model rejects (FastAPI: a 500, never sent)."""

    name, path, tag = "rejected_answer", "/api/v1/rejected_answer", "training"
    oneof = result = "optim_step"
    sequenced, hot = True, True
    body: ClassVar[type[BaseModel] | None] = None

    async def submit_request(self, owner: str, body: Any) -> pb.SubmitRequest:
        return pb.SubmitRequest(owner=owner, optim_step=pb.OptimStep(model_id=MODEL, seq_id=1))

    def response(self, reply: pb.SubmitReply, body: Any) -> BaseModel:
        return _Rejected(request_id=7)

    def answer(self, result: pb.JobResult, request_type: str | None) -> Response:
        raise AssertionError("never answered")


def test_a_response_the_model_rejects_is_answered_alike(
    standin: tuple[StandInScheduler, str], sched: StandInScheduler
) -> None:
    """The response model judges what the endpoint returns on both paths: here it refuses it
    (FastAPI's ResponseValidationError: the server error, byte for byte the same)."""
    with registry.registered(_RejectedAnswer()):
        with (
            gateway_client(standin[1], raise_errors=False) as fast,
            gateway_client(standin[1], direct=False, raise_errors=False) as plain,
        ):
            assert "/api/v1/rejected_answer" in _served_directly(fast.app)
            answers = []
            for client in (fast, plain):
                r = client.post("/api/v1/rejected_answer", content=b"")
                answers.append((r.status_code, r.headers.get("content-type"), r.content))
    assert answers[0] == answers[1]
    assert answers[0][0] == 500


# ---------------------------------------------------------------- the dependencies it calls
CALLS: list[str] = []


async def _caller(x_key: Annotated[str | None, Header(alias="X-Key")] = None) -> str:
    CALLS.append("caller")
    if x_key != "good":
        raise ApiError(401, "bad key")
    return "alice"


async def _owner(caller: Annotated[str, Depends(_caller)]) -> str:
    CALLS.append("owner")
    return caller.upper()


def _quota(caller: Annotated[str, Depends(_caller)], request: Request) -> int:
    """A plain function: FastAPI runs it in its thread pool, and so does the direct layer."""
    CALLS.append("quota")
    return len(caller) + len(request.url.path)


async def _audit(trace: Annotated[str, Header(alias="X-Trace")]) -> None:
    CALLS.append(f"audit {trace}")


class _Echo(BaseModel):
    n: int


class _Echoed(BaseModel):
    owner: str
    quota: int
    n: int
    lang: str | None


def _tiny_app(hot: bool) -> FastAPI:
    """A route with every kind of parameter the direct layer resolves: a route-level
    dependency with a required header, two dependencies sharing a third (called once), a plain
    function dependency, an optional header and a body model."""
    router = APIRouter(route_class=direct.HotRoute if hot else APIRoute)

    @router.post("/echo", dependencies=[Depends(_audit)])
    async def echo(
        body: _Echo,
        owner: Annotated[str, Depends(_owner)],
        quota: Annotated[int, Depends(_quota)],
        lang: Annotated[str | None, Header(alias="Accept-Language")] = None,
    ) -> _Echoed:
        CALLS.append("echo")
        return _Echoed(owner=owner, quota=quota, n=body.n, lang=lang)

    @router.post("/wrong")
    async def wrong(owner: Annotated[str, Depends(_owner)]) -> _Echo:
        return cast(_Echo, {"n": "not a number"})

    app = FastAPI()
    install_error_handlers(app)
    app.include_router(router)
    app.add_middleware(direct.DirectRoutes, routes=direct.hot_routes(router))
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=1 << 20)
    return app


TINY: dict[str, tuple[str, dict[str, Any]]] = {
    "plain": ("/echo", {"json": {"n": 3}, "headers": {"X-Key": "good", "X-Trace": "t"}}),
    "language": (
        "/echo",
        {"json": {"n": 3}, "headers": {"X-Key": "good", "X-Trace": "t", "Accept-Language": "fr"}},
    ),
    "bad key": ("/echo", {"json": {"n": 3}, "headers": {"X-Key": "bad", "X-Trace": "t"}}),
    "no trace": ("/echo", {"json": {"n": 3}, "headers": {"X-Key": "good"}}),
    "bad body": ("/echo", {"json": {"n": "x"}, "headers": {"X-Key": "good", "X-Trace": "t"}}),
    "bad key and body": ("/echo", {"json": {"n": "x"}, "headers": {"X-Key": "no", "X-Trace": "t"}}),
    "json+": (
        "/echo",
        {
            "content": b'{"n": 4}',
            "headers": {"X-Key": "good", "X-Trace": "t", "Content-Type": "application/v+json"},
        },
    ),
    "rejected answer": ("/wrong", {"headers": {"X-Key": "good"}}),
}


def _spy(inner: Any, reached: list[str]) -> Any:
    async def spy(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            reached.append(scope["path"])
        await inner(scope, receive, send)

    return spy


@pytest.mark.parametrize("case", TINY)
def test_dependencies_are_the_routes_own_functions(case: str) -> None:
    """The direct layer calls the functions the route declares, in FastAPI's order and as
    often (a shared dependency once), and answers what FastAPI answers, errors included."""
    path, kwargs = TINY[case]
    seen = []
    fell_back: list[str] = []
    for hot in (True, False):
        app = _tiny_app(hot)
        app.middleware_stack = app.build_middleware_stack()
        layer = _direct_layer(app)
        layer.app = _spy(layer.app, fell_back)
        with TestClient(app, raise_server_exceptions=False) as client:
            CALLS.clear()
            fell_back.clear()
            r = client.post(path, **kwargs)
            headers = {k: v for k, v in r.headers.items() if k != "date"}
            seen.append((r.status_code, headers, r.content, list(CALLS), bool(fell_back)))
    direct_answer, fastapi_answer = seen
    assert direct_answer[:3] == fastapi_answer[:3]
    assert fastapi_answer[4]  # without the layer every request is FastAPI's
    # A dependency that raises answers before the body is judged, as under FastAPI.
    served = case not in ("no trace", "bad body")
    assert direct_answer[4] == (not served)
    if served:
        assert direct_answer[3] == fastapi_answer[3]
    if case == "plain":
        assert fastapi_answer[3] == ["audit t", "caller", "owner", "quota", "echo"]


def test_a_parameter_it_cannot_resolve_stops_the_start() -> None:
    router = APIRouter(route_class=direct.HotRoute)

    @router.post("/paged")
    async def paged(limit: int = 10) -> dict[str, int]:
        return {"limit": limit}

    with pytest.raises(ValueError, match=r"hot route /paged: cannot resolve parameter 'limit'"):
        direct.DirectRoutes(FastAPI(), direct.hot_routes(router))
