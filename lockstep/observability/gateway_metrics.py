"""The gateway's HTTP metrics (its registry, `metrics.GATEWAY`): latency per route template,
requests in flight, compressed bodies, and its calls to the scheduler as it sees them."""

from __future__ import annotations

import functools
from typing import Any

from prometheus_client import Counter, Gauge, Histogram

from lockstep.observability.metrics import GATEWAY, HTTP_BUCKETS, gateway_error

HTTP_SECONDS = Histogram(
    "lockstep_http_request_duration_seconds",
    "HTTP request latency by method, route template and status (retrieve_future is a long "
    "poll: it is held up to --long-poll-seconds).",
    ["method", "route", "status"],
    buckets=HTTP_BUCKETS,
    registry=GATEWAY,
)
GRPC_CLIENT_SECONDS = Histogram(
    "lockstep_grpc_client_duration_seconds",
    "Gateway -> scheduler gRPC calls as the gateway sees them, by method (RetrieveFuture: a "
    "long poll).",
    ["method"],
    buckets=HTTP_BUCKETS,
    registry=GATEWAY,
)
HTTP_IN_FLIGHT = Gauge(
    "lockstep_http_requests_in_flight",
    "HTTP requests being served now (long polls included).",
    registry=GATEWAY,
)
HTTP_COMPRESSED_BODIES = Counter(
    "lockstep_http_compressed_bodies_total",
    "Request bodies received with a Content-Encoding (the SDK's zstd fwd/bwd bodies), and "
    "their bytes before and after decompression.",
    ["encoding"],
    registry=GATEWAY,
)
HTTP_COMPRESSED_BYTES = Counter(
    "lockstep_http_compressed_body_bytes_total",
    "Bytes of compressed request bodies as received (form=wire) and decompressed (form=plain).",
    ["encoding", "form"],
    registry=GATEWAY,
)


_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


def http_error_category(status: int) -> str | None:
    """The error category of an HTTP status (None: not an error)."""
    if status < 400:
        return None
    if status in (401, 403):
        return "auth"
    if status in (404, 405):
        return "not_found"
    if status == 429:
        return "capacity"
    if status in (502, 503, 504):
        return "unavailable"
    return "server" if status >= 500 else "user"


def compressed_body(encoding: str, wire_bytes: int, plain_bytes: int) -> None:
    HTTP_COMPRESSED_BODIES.labels(encoding).inc()
    HTTP_COMPRESSED_BYTES.labels(encoding, "wire").inc(wire_bytes)
    HTTP_COMPRESSED_BYTES.labels(encoding, "plain").inc(plain_bytes)


@functools.lru_cache(maxsize=4096)
def _http_series(method: str, route: str, status: int) -> Any:
    """One series' child (route templates and statuses are few): `labels()` per request costs
    more than the observation."""
    method = method if method in _METHODS else "OTHER"
    return HTTP_SECONDS.labels(method, route, str(status))


def http_request(method: str, route: str, status: int, seconds: float) -> None:
    _http_series(method, route, status).observe(seconds)
    category = http_error_category(status)
    if category is not None:
        gateway_error(category)


@functools.lru_cache(maxsize=256)
def _grpc_series(method: str) -> Any:
    return GRPC_CLIENT_SECONDS.labels(method)


def grpc_call(method: str, seconds: float) -> None:
    """One call to the scheduler, as the gateway timed it."""
    _grpc_series(method).observe(seconds)
