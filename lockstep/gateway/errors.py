"""Error mapping: gRPC status -> HTTP status, and the JSON error bodies the SDK expects.

Rules (tinker-protocol.md §2.3): every 4xx has a JSON body `{"detail": "..."}`; a permanent
error is never 408/409/429/5xx (the SDK retries those for minutes); transient capacity
problems are 429 (backpressure) and an unreachable scheduler is 503.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Scope

log = logging.getLogger("lockstep.gateway")


class ApiError(Exception):
    """An HTTP error answered as `{"detail": message}`."""

    def __init__(
        self, status_code: int, detail: str, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(detail)
        self.status_code = status_code
        self.detail = detail
        self.headers = headers


def bad_request(field: str, message: str) -> ApiError:
    """A 400 whose message names the offending field, e.g. `seq_id: must be >= 1`."""
    return ApiError(400, f"{field}: {message}")


# gRPC code -> HTTP status. PERMISSION_DENIED is a 404 so a caller cannot probe for other
# owners' ids. Permanent errors are 4xx; only transient ones are 429 / 503.
_GRPC_TO_HTTP: dict[grpc.StatusCode, int] = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.ALREADY_EXISTS: 400,
    grpc.StatusCode.UNIMPLEMENTED: 400,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.PERMISSION_DENIED: 404,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 503,
    grpc.StatusCode.ABORTED: 503,
    grpc.StatusCode.CANCELLED: 503,
}


def http_status_for(code: grpc.StatusCode) -> int:
    """HTTP status for a gRPC status code (INTERNAL, UNKNOWN, DATA_LOSS, ... -> 500)."""
    return _GRPC_TO_HTTP.get(code, 500)


def rpc_error_to_api_error(err: grpc.aio.AioRpcError) -> ApiError:
    """Translate a failed scheduler call into the HTTP error the SDK should see."""
    code = err.code()
    status = http_status_for(code)
    details = err.details() or code.name.lower()
    if code == grpc.StatusCode.PERMISSION_DENIED:
        details = "not found"
    elif code == grpc.StatusCode.UNAVAILABLE:
        details = f"scheduler unavailable: {details}"
    headers = {"Retry-After": "1"} if status in (429, 503) else None
    if status >= 500:
        log.warning("scheduler call failed: %s %s", code.name, err.details())
    return ApiError(status, details, headers)


def describe_validation_error(err: dict[str, Any]) -> str:
    """One pydantic error as `field.path: message`, with the `body`/`query` prefix dropped."""
    kind = err.get("type", "")
    ctx = err.get("ctx") or {}
    if kind == "json_invalid":
        return f"body: not valid JSON ({ctx.get('error', 'parse error')})"
    loc: Sequence[Any] = err.get("loc", ())
    if loc and loc[0] in ("body", "query", "path", "header"):
        where = loc[0]
        loc = loc[1:]
    else:
        where = "body"
    field = ""
    for part in loc:
        field += f"[{part}]" if isinstance(part, int) else f".{part}" if field else str(part)
    field = field or where
    if kind == "missing":
        message = "field required"
    elif kind == "greater_than_equal":
        message = f"must be >= {ctx.get('ge')}"
    elif kind == "greater_than":
        message = f"must be > {ctx.get('gt')}"
    elif kind == "less_than_equal":
        message = f"must be <= {ctx.get('le')}"
    elif kind == "less_than":
        message = f"must be < {ctx.get('lt')}"
    elif kind == "value_error":
        message = str(ctx.get("error", err.get("msg", "invalid value")))
    elif kind == "finite_number":
        message = "must be a finite number"
    else:
        message = str(err.get("msg", "invalid value"))
    return f"{field}: {message}"


async def _api_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    return JSONResponse({"detail": exc.detail}, status_code=exc.status_code, headers=exc.headers)


# Set in the scope of a request whose error answer is the scheduler's own: what the scheduler
# refused, it has judged for the seq order already (lockstep.gateway.refusals).
_SCHEDULER_ANSWERED = "lockstep.scheduler_answered"


def answered_by_scheduler(scope: Scope) -> bool:
    return bool(scope.get(_SCHEDULER_ANSWERED))


async def _rpc_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, grpc.aio.AioRpcError)
    request.scope[_SCHEDULER_ANSWERED] = True  # the same dict the outer middleware holds
    return await _api_error_handler(request, rpc_error_to_api_error(exc))


async def _validation_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    detail = "; ".join(describe_validation_error(e) for e in exc.errors()) or "invalid request"
    return JSONResponse({"detail": detail}, status_code=400)


async def _http_exception_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    detail = exc.detail if exc.detail else "error"
    return JSONResponse(
        {"detail": detail}, status_code=exc.status_code, headers=getattr(exc, "headers", None)
    )


def install_error_handlers(app: FastAPI) -> None:
    """Every error leaves as JSON `{"detail": ...}`; validation errors are 400, not 422."""
    app.add_exception_handler(ApiError, _api_error_handler)
    app.add_exception_handler(grpc.aio.AioRpcError, _rpc_error_handler)
    app.add_exception_handler(RequestValidationError, _validation_error_handler)
    app.add_exception_handler(StarletteHTTPException, _http_exception_handler)
