"""The hot routes served without FastAPI's routing and dependency solving.

The SDK's every training step and sample goes through a few routes (`HOT_PATHS`); on them
FastAPI's route matching over every route and its per-request dependency solving cost more
CPU than the route's own work. `DirectRoutes` (a pure ASGI middleware inside the body limit)
serves those paths itself: it calls the same endpoint function the FastAPI route holds, with
the same arguments resolved the same way (the caller from `authenticate`, the app's state, the
headers, the body model validated from `json.loads` as FastAPI does), answers with the same
serialization, and sends the endpoint's errors through the app's own exception handlers.

Anything that does not take the plain path — a body that is not JSON, fails to parse or to
validate, a missing or bad key — goes on to FastAPI untouched, which answers it as it always
has (its error order and bodies are its own). The routes stay registered in FastAPI, so the
OpenAPI document and the fallback are unchanged.
"""

from __future__ import annotations

import enum
import inspect
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Annotated, Any, get_args, get_origin

from fastapi import FastAPI
from fastapi.params import Depends, Header
from fastapi.routing import APIRoute, iter_route_contexts
from pydantic import BaseModel, TypeAdapter, ValidationError
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import Response

from lockstep.gateway import deps
from lockstep.gateway.body import ASGIApp, Receive, Scope, Send, replay
from lockstep.gateway.errors import ApiError

# What every training step and sample calls (forward is a forward_backward).
HOT_PATHS = (
    "/api/v1/forward_backward",
    "/api/v1/optim_step",
    "/api/v1/asample",
    "/api/v1/retrieve_future",
    "/api/v1/retrieve_futures",
)

# The dependencies a direct route may have: each resolved from the caller or the app's state.
_CALLER: dict[Any, Callable[[deps.Caller], Any]] = {
    deps.require_owner: lambda caller: caller.owner,
    deps.key_quota: lambda caller: caller.max_training_runs,
    deps.require_caller: lambda caller: caller,
}
_STATE: dict[Any, str] = {
    deps.get_scheduler: "scheduler",
    deps.get_settings: "settings",
    deps.get_answers: "answers",
}


class _Kind(enum.Enum):
    """Where an endpoint parameter's value comes from."""

    CALLER = "caller"  # the authenticated caller (owner, quota)
    STATE = "state"  # the app's state (scheduler stub, settings, prefetched answers)
    HEADER = "header"
    REQUEST = "request"  # the request itself (an op that reads its raw body)
    BODY = "body"  # the JSON body, validated by its model


@dataclass(frozen=True)
class _Param:
    name: str
    kind: _Kind
    source: Any  # caller: its resolver; state: the attribute; header: its name, lower case
    default: Any = None


@dataclass(frozen=True)
class _Route:
    route: APIRoute
    params: tuple[_Param, ...]
    body: TypeAdapter[Any] | None  # the JSON body's model, if the endpoint takes one
    response: TypeAdapter[Any] | None  # how a non-Response return is serialized


def _param(name: str, parameter: inspect.Parameter) -> _Param:
    annotation = parameter.annotation
    if annotation is Request:
        return _Param(name, _Kind.REQUEST, None)
    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        return _Param(name, _Kind.BODY, None)
    if get_origin(annotation) is Annotated:
        marker = get_args(annotation)[1]
        if isinstance(marker, Depends) and marker.dependency in _CALLER:
            return _Param(name, _Kind.CALLER, _CALLER[marker.dependency])
        if isinstance(marker, Depends) and marker.dependency in _STATE:
            return _Param(name, _Kind.STATE, _STATE[marker.dependency])
        if isinstance(marker, Header) and marker.alias:
            default = None if parameter.default is inspect.Parameter.empty else parameter.default
            return _Param(name, _Kind.HEADER, marker.alias.lower(), default)
    raise ValueError(f"direct route: cannot resolve parameter {name!r} ({annotation!r})")


def _direct(route: APIRoute) -> _Route:
    if route.dependencies:
        raise ValueError(f"direct route {route.path}: route-level dependencies")
    signature = inspect.signature(route.endpoint, eval_str=True)
    params = tuple(_param(name, p) for name, p in signature.parameters.items())
    bodies = [signature.parameters[p.name].annotation for p in params if p.kind is _Kind.BODY]
    if len(bodies) > 1:
        raise ValueError(f"direct route {route.path}: more than one body")
    model = route.response_model
    return _Route(
        route,
        params,
        TypeAdapter(bodies[0]) if bodies else None,
        TypeAdapter(model) if model is not None else None,
    )


def routes(app: FastAPI, paths: Iterable[str] = HOT_PATHS) -> dict[str, _Route]:
    """The app's POST routes of `paths`, ready to serve directly; a path the app does not serve
    (or serves with a parameter this module cannot resolve) is an error at start."""
    wanted = set(paths)
    found: dict[str, _Route] = {}
    for context in iter_route_contexts(app.routes):
        route = context.original_route
        if (
            isinstance(route, APIRoute)
            and context.path in wanted
            and route.path == context.path
            and "POST" in (route.methods or ())
        ):
            found[route.path] = _direct(route)
    if missing := wanted - found.keys():
        raise ValueError(f"direct routes: no POST route for {sorted(missing)}")
    return found


def _is_json(headers: Headers) -> bool:
    """The content type FastAPI reads as JSON, in the one spelling clients send."""
    content_type = headers.get("content-type", "")
    return content_type.partition(";")[0].strip().lower() == "application/json"


async def _read(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


class _Fallback(Exception):
    """The request leaves the plain path: FastAPI answers it."""


class DirectRoutes:
    """Serves `routes` (from `routes(app)`) directly; every other request goes to `app`."""

    def __init__(self, app: ASGIApp, routes: dict[str, _Route]) -> None:
        self.app = app
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        direct = self.routes.get(scope["path"]) if scope["type"] == "http" else None
        if direct is None or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        raw = await _read(receive)
        receive = replay(raw, receive)
        request = Request(scope, receive)
        try:
            kwargs = _arguments(direct, request, raw)
        except _Fallback:
            await self.app(scope, receive, send)
            return
        scope["route"] = direct.route  # as FastAPI's routing sets it (the metrics' label)
        try:
            result = await direct.route.endpoint(**kwargs)
            if not isinstance(result, Response):
                assert direct.response is not None
                content = direct.response.dump_json(result, by_alias=True)
                result = Response(content, media_type="application/json")
        except Exception as exc:
            handler = _handler(request, exc)
            if handler is None:
                raise
            result = handler(request, exc)
            if inspect.isawaitable(result):
                result = await result
        await result(scope, receive, send)


def _arguments(direct: _Route, request: Request, raw: bytes) -> dict[str, Any]:
    """The endpoint's arguments, resolved as FastAPI would; `_Fallback` where FastAPI would
    answer something else (an error) or where its reading might differ."""
    body: Any = None
    if direct.body is not None:
        if not raw or not _is_json(request.headers):
            raise _Fallback
        try:
            body = json.loads(raw)  # what FastAPI's `request.json()` does
        except ValueError as e:
            raise _Fallback from e
    caller: deps.Caller | None = None
    state = request.app.state
    kwargs: dict[str, Any] = {}
    for p in direct.params:
        if p.kind is _Kind.CALLER:
            if caller is None:
                try:
                    caller = deps.authenticate(request, request.headers.get("x-api-key"))
                except ApiError as e:
                    raise _Fallback from e
            kwargs[p.name] = p.source(caller)
        elif p.kind is _Kind.STATE:
            kwargs[p.name] = getattr(state, p.source)
        elif p.kind is _Kind.HEADER:
            kwargs[p.name] = request.headers.get(p.source, p.default)
        elif p.kind is _Kind.REQUEST:
            kwargs[p.name] = request
        else:
            assert direct.body is not None
            try:
                kwargs[p.name] = direct.body.validate_python(body, from_attributes=True)
            except ValidationError as e:
                raise _Fallback from e
    return kwargs


def _handler(request: Request, exc: Exception) -> Any:
    """The app's exception handler of `exc` (by its class's MRO, as Starlette looks it up)."""
    handlers = request.app.exception_handlers
    for cls in type(exc).__mro__:
        if cls in handlers and cls is not Exception:
            return handlers[cls]
    return None
