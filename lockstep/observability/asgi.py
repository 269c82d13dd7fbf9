"""The gateway's metrics: a pure ASGI middleware timing every request, and `GET /metrics`.

The route label is the template of the route that served the request
(`/api/v1/training_runs/{run_id}`), read from the scope once routing has happened, so latencies
have one series per endpoint whatever ids the paths carry; a path no route serves is
route="unmatched".
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from prometheus_client.exposition import choose_encoder
from starlette.requests import Request
from starlette.responses import Response

from lockstep.observability import gateway_metrics, metrics

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

UNMATCHED = "unmatched"


class MetricsMiddleware:
    """Observes lockstep_http_request_duration_seconds and lockstep_http_requests_in_flight."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500  # what the client gets if the app raises before answering

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        start = time.perf_counter()
        gateway_metrics.HTTP_IN_FLIGHT.inc()
        try:
            await self.app(scope, receive, send_status)
        finally:
            gateway_metrics.HTTP_IN_FLIGHT.dec()
            route = getattr(scope.get("route"), "path", None) or UNMATCHED  # set by routing
            gateway_metrics.http_request(
                scope.get("method", ""), route, status, time.perf_counter() - start
            )


async def metrics_endpoint(request: Request) -> Response:
    """Prometheus exposition of the gateway's registry (OpenMetrics when the scraper asks)."""
    encoder, content_type = choose_encoder(request.headers.get("accept", ""))
    return Response(encoder(metrics.GATEWAY), headers={"Content-Type": content_type})
