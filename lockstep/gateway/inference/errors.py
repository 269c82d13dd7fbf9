"""Errors of the compatible routes in the shape their clients parse (OpenAI's, Anthropic's).

`compat_route(render)` is an `APIRoute` class for a router: whatever a handler or its
dependencies raise (a refused key, a bad field, a scheduler status) leaves as `render(status,
message, param)` instead of the Tinker routes' `{"detail": ...}`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine
from typing import Any

import grpc
from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from lockstep.gateway.errors import ApiError, describe_validation_error, rpc_error_to_api_error

log = logging.getLogger("lockstep.gateway")

Render = Callable[[int, str, str | None], JSONResponse]


def _param(message: str) -> str | None:
    """`field: message` -> field (the convention of every 4xx message here)."""
    head, sep, _ = message.partition(": ")
    return head if sep and " " not in head else None


def as_api_error(exc: Exception) -> ApiError | None:
    """The HTTP error an exception of a handler stands for (None: not an expected one)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, grpc.aio.AioRpcError):
        return rpc_error_to_api_error(exc)
    if isinstance(exc, RequestValidationError):
        detail = "; ".join(describe_validation_error(e) for e in exc.errors())
        return ApiError(400, detail or "invalid request")
    if isinstance(exc, StarletteHTTPException):  # e.g. a body that is not UTF-8 JSON
        return ApiError(exc.status_code, f"body: {exc.detail}" if exc.detail else "error")
    return None


def compat_route(render: Render) -> type[APIRoute]:
    class CompatRoute(APIRoute):
        def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
            handler = super().get_route_handler()

            async def handle(request: Request) -> Response:
                try:
                    return await handler(request)
                except Exception as exc:
                    err = as_api_error(exc)
                    if err is None:
                        log.exception("compatible route %s failed", request.url.path)
                        return render(500, "internal error", None)
                    response = render(err.status_code, err.detail, _param(err.detail))
                    response.headers.update(err.headers or {})
                    return response

            return handle

    return CompatRoute


_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}


def openai_error(status: int, message: str, param: str | None) -> JSONResponse:
    kind = _OPENAI_TYPES.get(status, "server_error")
    code = "model_not_found" if status == 404 and param == "model" else None
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status)


_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def anthropic_error(status: int, message: str, param: str | None) -> JSONResponse:
    kind = _ANTHROPIC_TYPES.get(status, "api_error")
    return JSONResponse(
        {"type": "error", "error": {"type": kind, "message": message}}, status_code=status
    )
