"""A test stand-in for the scheduler: a real gRPC server with canned replies.

For the gateway's tests (the real scheduler lives in `lockstep.scheduler`). It records
every call and answers each RPC with a reply set by the test (a message, or a function of the
request), or aborts it with a gRPC status.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, TypeAlias

import grpc
from google.protobuf.message import Message

from lockstep.v1 import scheduler_pb2, scheduler_pb2_grpc

_SERVICE = scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"]
METHODS: tuple[str, ...] = tuple(m.name for m in _SERVICE.methods)

Reply: TypeAlias = Message | Callable[[Any], Message]


def _default_replies() -> dict[str, Reply]:
    replies: dict[str, Reply] = {
        m.name: getattr(scheduler_pb2, m.output_type.name)() for m in _SERVICE.methods
    }
    replies["Health"] = scheduler_pb2.HealthReply(ready=True, parts={"redis": "ready"})
    replies["CreateSession"] = scheduler_pb2.CreateSessionReply(session_id="sess-1")
    replies["Submit"] = scheduler_pb2.SubmitReply(request_id="req-1")
    replies["RetrieveFuture"] = scheduler_pb2.FutureReply(
        try_again=scheduler_pb2.TryAgain(queue_state="active")
    )
    return replies


class StandInScheduler(scheduler_pb2_grpc.SchedulerServicer):
    """Test stand-in for the Scheduler service (canned replies, recorded calls)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.calls: list[tuple[str, Any]] = []
        self.replies: dict[str, Reply] = _default_replies()
        self.errors: dict[str, tuple[grpc.StatusCode, str]] = {}

    def reset(self) -> None:
        with self._lock:
            self.calls.clear()
            self.replies = _default_replies()
            self.errors.clear()

    def fail(self, method: str, code: grpc.StatusCode, details: str) -> None:
        """Make `method` abort with `code` until reset."""
        self.errors[method] = (code, details)

    def requests(self, method: str) -> list[Any]:
        """The requests received by `method`, oldest first."""
        with self._lock:
            return [req for name, req in self.calls if name == method]

    def last(self, method: str) -> Any:
        reqs = self.requests(method)
        assert reqs, f"{method} was never called"
        return reqs[-1]

    def _answer(self, method: str, request: Any, context: grpc.ServicerContext) -> Message:
        with self._lock:
            self.calls.append((method, request))
            error = self.errors.get(method)
            reply = self.replies[method]
        if error is not None:
            context.abort(*error)
        return reply(request) if callable(reply) else reply


def _make_method(name: str) -> Callable[..., Message]:
    def method(self: StandInScheduler, request: Any, context: grpc.ServicerContext) -> Message:
        return self._answer(name, request, context)

    method.__name__ = name
    return method


for _name in METHODS:
    setattr(StandInScheduler, _name, _make_method(_name))


@contextmanager
def running_standin() -> Iterator[tuple[StandInScheduler, str]]:
    """Serve a StandInScheduler on a free loopback port; yields it and its address."""
    standin = StandInScheduler()
    server = grpc.server(ThreadPoolExecutor(max_workers=8))
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(standin, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield standin, f"127.0.0.1:{port}"
    finally:
        server.stop(grace=None)


TEST_API_KEY = "tml-gateway-test"


@contextmanager
def gateway_client(
    scheduler_address: str, direct: bool = True, raise_errors: bool = True, **overrides: Any
) -> Iterator[Any]:
    """A FastAPI TestClient of the gateway (lifespan run), sending TEST_API_KEY by default.
    `direct` False: without the direct layer; `raise_errors` False: a server error is answered
    (500) instead of raised in the test."""
    from fastapi.testclient import TestClient  # test-only dependency (httpx)

    from lockstep.gateway.app import create_app
    from lockstep.gateway.settings import GatewaySettings

    fields: dict[str, Any] = {
        "api_keys": frozenset({TEST_API_KEY}),
        "file_url_secret": b"gateway-test-secret",
        "long_poll_seconds": 2.0,
    }
    fields.update(overrides)
    settings = GatewaySettings(scheduler_address=scheduler_address, **fields)
    app = create_app(settings, direct=direct)
    with TestClient(app, raise_server_exceptions=raise_errors) as client:
        client.headers["X-API-Key"] = TEST_API_KEY
        yield client
