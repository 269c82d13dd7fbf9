"""The scheduler's ops HTTP server (`--metrics-port`): a daemon thread beside the grpc.aio loop.

    GET /metrics   Prometheus exposition of the scheduler's registry (prometheus_client's
                   WSGI app, the one `prometheus_client.start_http_server` serves)
    GET /livez     200 while the scheduler's event loop answers within 5 s (liveness)
    GET /healthz   200 when Redis and both engine processes are ready (readiness), the same
                   parts the gateway's /api/v1/healthz reports; 503 while starting

It starts before the engines load, so /livez answers during a long model load while /healthz
still says "starting".
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
from collections.abc import Awaitable, Callable, Iterable
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING, TypeVar
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

from lockstep.observability.metrics import SCHEDULER

if TYPE_CHECKING:
    from _typeshed.wsgi import StartResponse, WSGIEnvironment

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 5.0
T = TypeVar("T")


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    allow_reuse_address = True


class _Server6(_Server):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (stdlib signature)
        return  # scrapes and probes every few seconds: not worth a log line


class OpsServer:
    def __init__(
        self,
        host: str,
        port: int,
        loop: asyncio.AbstractEventLoop,
        registry: CollectorRegistry = SCHEDULER,
    ) -> None:
        self.loop = loop
        self.health: Callable[[], Awaitable[dict[str, str]]] | None = None
        self._metrics = make_wsgi_app(registry)
        server_class = _Server6 if ":" in host else _Server
        self._httpd = make_server(
            host, port, self._app, server_class=server_class, handler_class=_QuietHandler
        )
        self.port = int(self._httpd.server_port)
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, name="ops-http", daemon=True
        )

    def start(self) -> OpsServer:
        self._thread.start()
        return self

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def _run(self, make: Callable[[], Awaitable[T]]) -> T:
        """Await `make()` on the scheduler's event loop, from this server's thread."""

        async def call() -> T:
            return await make()

        future = asyncio.run_coroutine_threadsafe(call(), self.loop)
        try:
            return future.result(PROBE_TIMEOUT_S)
        except TimeoutError:
            future.cancel()
            raise

    def _app(self, environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/metrics":
            body: Iterable[bytes] = self._metrics(environ, start_response)
            return body
        if path == "/livez":
            try:
                self._run(lambda: asyncio.sleep(0))
            except Exception:
                return _json(start_response, 503, {"status": "event loop unresponsive"})
            return _json(start_response, 200, {"status": "ok"})
        if path == "/healthz":
            return self._healthz(start_response)
        return _json(start_response, 404, {"detail": "not found: try /metrics, /healthz, /livez"})

    def _healthz(self, start_response: StartResponse) -> Iterable[bytes]:
        if self.health is None:
            return _json(start_response, 503, {"status": "starting"})
        try:
            parts: dict[str, str] = self._run(self.health)
        except Exception as exc:
            return _json(
                start_response, 503, {"status": "unavailable", "parts": {"scheduler": repr(exc)}}
            )
        ready = all(v == "ready" for v in parts.values())
        return _json(
            start_response,
            200 if ready else 503,
            {"status": "ok" if ready else "unavailable", "parts": parts},
        )


def _json(start_response: StartResponse, status: int, body: dict[str, object]) -> list[bytes]:
    data = json.dumps(body).encode()
    reason = {200: "OK", 404: "Not Found", 503: "Service Unavailable"}[status]
    start_response(
        f"{status} {reason}",
        [("Content-Type", "application/json"), ("Content-Length", str(len(data)))],
    )
    return [data]


def start_ops_server(host: str, port: int) -> OpsServer:
    """Serve /metrics, /livez and /healthz on host:port (port 0: a free one) from now on."""
    server = OpsServer(host, port, asyncio.get_running_loop()).start()
    log.info(
        "scheduler metrics on http://%s:%d/metrics (health: /healthz, /livez)",
        f"[{host}]" if ":" in host else host,
        server.port,
    )
    return server
