"""The hot routes served without FastAPI's routing and dependency solving.

The SDK's every training step and sample goes through a few routes; on them FastAPI's route
matching over every route and its per-request dependency solving cost more CPU than the route's
own work. A route is hot where it is declared: an op says so (`GatewayOp.hot`, and the op
registry gives its route the `HotRoute` class), and so do the futures routes every hot op is
answered through (`routes/futures.py`). `DirectRoutes` (a pure ASGI middleware inside the body
limit) serves those paths itself, from a plan made once at start (`plan`): it calls the route's
own endpoint with its arguments resolved by calling the very dependency functions the route
declares (`Depends`, in FastAPI's order, each once per request), the headers and the body model
validated as FastAPI validates it; it validates and serializes a returned value with the
route's response model as FastAPI does (a value the model rejects is FastAPI's
`ResponseValidationError`, a 500), and sends the errors through the app's own handlers. A
parameter it cannot resolve stops the gateway's start, naming the route.

The body is the one the body-limit middleware read and kept in the scope (`body.request_body`):
nothing reads the client's stream twice. Anything off the plain path — a body that is not JSON
(`body.is_json`, FastAPI's test), does not parse, or fails its model — goes on to FastAPI
untouched, which answers it as it always has (its error order and bodies are its own). The
routes stay registered in FastAPI, so the OpenAPI document and the fallback are unchanged (a
request that falls back after a dependency ran has FastAPI run it again: dependencies are pure
reads of the request and the app's state). Only public FastAPI and Starlette API is used
(`APIRoute` and its attributes, the `Depends` and `Header` markers, `ResponseValidationError`).
"""

from __future__ import annotations

import enum
import inspect
import json
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from types import NoneType, UnionType
from typing import Annotated, Protocol, Union, cast, get_args, get_origin

from fastapi import APIRouter
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import ResponseValidationError
from fastapi.params import Depends, Header
from fastapi.routing import APIRoute
from pydantic import BaseModel, TypeAdapter, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.requests import HTTPConnection, Request
from starlette.responses import JSONResponse, Response

from lockstep.gateway.body import ASGIApp, Receive, Scope, Send, is_json, request_body


class HotRoute(APIRoute):
    """A route `DirectRoutes` serves too; FastAPI keeps it (OpenAPI, the fallback)."""


def hot_routes(*routers: APIRouter) -> list[HotRoute]:
    """The hot routes the routers declare (each router's own routes, before inclusion)."""
    return [r for router in routers for r in router.routes if isinstance(r, HotRoute)]


Call = Callable[..., object]
AsyncCall = Callable[..., Awaitable[object]]  # a module constant: typing's aliases cost per use
Handler = Callable[[Request, Exception], object]


class _Source(enum.Enum):
    """Where a parameter's value comes from."""

    CONNECTION = "connection"  # the request itself
    HEADER = "header"
    BODY = "body"  # the JSON body, validated by its model
    DEPENDENCY = "dependency"  # what a dependency function returns


@dataclass(frozen=True)
class _Param:
    name: str
    source: _Source
    header: str = ""  # its header's name, lower case
    default: str | None = None
    required: bool = False  # a header without a default: missing, FastAPI answers 422
    dependency: _Dependency | None = None


@dataclass(frozen=True)
class _Dependency:
    """A function to call with its own parameters resolved (an endpoint is one too)."""

    call: Call
    params: tuple[_Param, ...]
    cached: bool  # FastAPI's `use_cache`: called once per request however often it is named
    is_async: bool  # a coroutine function (else FastAPI runs it in its thread pool)


@dataclass(frozen=True)
class _Step:
    """One call of a request's resolution: its function and where each argument comes from
    (`_Param`s; a dependency's value is the value of step `value_of[name]`)."""

    dep: _Dependency
    value_of: dict[str, int]  # parameter -> the earlier step whose value it takes


def _steps(prior: tuple[_Dependency, ...], endpoint: _Dependency) -> tuple[_Step, ...]:
    """Every call a request makes, in FastAPI's order (depth first: a function's dependencies
    before it, the route's own `dependencies=[...]` first), a cached function once; the
    endpoint last."""
    steps: list[_Step] = []
    done: dict[Call, int] = {}

    def visit(dep: _Dependency) -> int:
        if dep.cached and dep.call in done:
            return done[dep.call]
        value_of = {p.name: visit(p.dependency) for p in dep.params if p.dependency is not None}
        steps.append(_Step(dep, value_of))
        if dep.cached:
            done[dep.call] = len(steps) - 1
        return len(steps) - 1

    for dep in (*prior, endpoint):
        visit(dep)
    return tuple(steps)


@dataclass(frozen=True)
class _Plan:
    """How one hot route is served."""

    route: HotRoute
    steps: tuple[_Step, ...]  # the endpoint's call last
    body: TypeAdapter[object] | None  # the JSON body's model, if the endpoint takes one
    response: TypeAdapter[object] | None  # the response model a returned value is checked by


def _header_type_ok(annotation: object) -> bool:
    """A header the route reads as a plain string (optional or not): nothing to validate."""
    if annotation is str:
        return True
    origin = get_origin(annotation)
    return origin in (Union, UnionType) and set(get_args(annotation)) == {str, NoneType}


def _param(where: str, name: str, parameter: inspect.Parameter, body_ok: bool) -> _Param:
    annotation = parameter.annotation
    if annotation in (Request, HTTPConnection):
        return _Param(name, _Source.CONNECTION)
    if body_ok and inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        return _Param(name, _Source.BODY)
    if get_origin(annotation) is Annotated:
        kind, *markers = get_args(annotation)
        marker = markers[-1] if markers else None
        if isinstance(marker, Depends) and marker.dependency is not None:
            solved = _dependency(where, marker.dependency, marker.use_cache)
            return _Param(name, _Source.DEPENDENCY, dependency=solved)
        if isinstance(marker, Header) and _header_type_ok(kind):
            header = marker.alias or name.replace("_", "-")
            empty = parameter.default is inspect.Parameter.empty
            if not empty and not isinstance(parameter.default, (str, NoneType)):
                raise ValueError(f"hot route {where}: header {name!r} has a non-text default")
            default = None if empty else parameter.default
            return _Param(name, _Source.HEADER, header.lower(), default, required=empty)
    raise ValueError(
        f"hot route {where}: cannot resolve parameter {name!r} ({annotation!r}); serve the "
        "route through FastAPI (not hot) or give it parameters the direct layer resolves"
    )


def _dependency(where: str, call: Call, cached: bool = True, body_ok: bool = False) -> _Dependency:
    if inspect.isgeneratorfunction(call) or inspect.isasyncgenfunction(call):
        raise ValueError(f"hot route {where}: dependency {call.__name__} yields")
    signature = inspect.signature(call, eval_str=True)
    params = tuple(_param(where, n, p, body_ok) for n, p in signature.parameters.items())
    return _Dependency(call, params, cached, inspect.iscoroutinefunction(call))


def plan(route: HotRoute) -> _Plan:
    """How `route` is served directly; a ValueError names what cannot be (at start)."""
    where = route.path
    if route.response_model_include is not None or route.response_model_exclude is not None:
        raise ValueError(f"hot route {where}: response_model_include/exclude")
    prior = tuple(
        _dependency(where, d.dependency, d.use_cache)
        for d in route.dependencies
        if d.dependency is not None
    )
    endpoint = _dependency(where, route.endpoint, cached=False, body_ok=True)
    bodies = [
        inspect.signature(route.endpoint, eval_str=True).parameters[p.name].annotation
        for p in endpoint.params
        if p.source is _Source.BODY
    ]
    if len(bodies) > 1:
        raise ValueError(f"hot route {where}: more than one body")
    model = route.response_model
    return _Plan(
        route,
        _steps(prior, endpoint),
        TypeAdapter(bodies[0]) if bodies else None,
        TypeAdapter(model) if model is not None else None,
    )


class _Fallback(Exception):
    """The request leaves the plain path: FastAPI answers it."""


async def _resolve(direct: _Plan, request: Request, body: object) -> object:
    """Make the request's calls (`_steps`) and answer the endpoint's value. Each function's
    arguments come in FastAPI's order: its dependencies' values, then the headers, then the
    body. A function that raises raises here (the app's handler answers, as under FastAPI); a
    missing required header or a body its model refuses is `_Fallback`."""
    values: list[object] = []
    for step in direct.steps:
        kwargs: dict[str, object] = {}
        for p in step.dep.params:
            source = p.source
            if source is _Source.DEPENDENCY:
                kwargs[p.name] = values[step.value_of[p.name]]
            elif source is _Source.CONNECTION:
                kwargs[p.name] = request
            elif source is _Source.HEADER:
                value = request.headers.get(p.header, p.default)
                if value is None and p.required:
                    raise _Fallback
                kwargs[p.name] = value
        for p in step.dep.params:  # the body last, as FastAPI validates it
            if p.source is _Source.BODY:
                assert direct.body is not None
                try:
                    kwargs[p.name] = direct.body.validate_python(body, from_attributes=True)
                except ValidationError as e:
                    raise _Fallback from e
        if step is direct.steps[-1]:
            request.scope["route"] = direct.route  # as FastAPI's routing sets it (metrics)
        values.append(await _invoke(step.dep, kwargs))
    return values[-1]


async def _invoke(dep: _Dependency, kwargs: dict[str, object]) -> object:
    """As FastAPI calls an endpoint or a dependency: a coroutine awaited, a plain function in
    the thread pool."""
    if dep.is_async:
        return await cast(AsyncCall, dep.call)(**kwargs)
    return await run_in_threadpool(dep.call, **kwargs)


class _ExceptionHandlers(Protocol):
    exception_handlers: dict[type[Exception], Handler]


class DirectRoutes:
    """Serves `routes` directly; every other request goes to `app`. Sits inside the body-limit
    middleware, which keeps the body in the scope."""

    def __init__(self, app: ASGIApp, routes: Sequence[HotRoute]) -> None:
        self.app = app
        self.plans: dict[str, _Plan] = {}
        for route in routes:
            if "POST" not in (route.methods or ()) or route.path in self.plans:
                raise ValueError(f"hot route {route.path}: one POST route per path")
            self.plans[route.path] = plan(route)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        direct = self.plans.get(scope["path"]) if scope["type"] == "http" else None
        if direct is None or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive)
        try:
            response = await self._serve(direct, request)
        except _Fallback:
            await self.app(scope, receive, send)
            return
        await response(scope, receive, send)

    async def _serve(self, direct: _Plan, request: Request) -> Response:
        body = _json_body(request) if direct.body is not None else None
        try:
            return _response(direct, await _resolve(direct, request, body))
        except _Fallback:
            raise
        except Exception as exc:
            handler = _handler(request.app, exc)
            if handler is None:
                raise
            answered = handler(request, exc)
            if inspect.isawaitable(answered):
                answered = await answered
            return cast(Response, answered)


def _json_body(request: Request) -> object:
    """The body as FastAPI's `request.json()` reads it; `_Fallback` where FastAPI would answer
    (not JSON, empty, unparsable) or read it otherwise."""
    raw = request_body(request.scope)
    if not raw or not is_json(request.headers.get("content-type")):
        raise _Fallback
    try:
        return json.loads(raw)
    except ValueError as e:
        raise _Fallback from e


def _response(direct: _Plan, result: object) -> Response:
    """What FastAPI answers for the endpoint's return value: a Response as it is; a value
    validated by the response model (`ResponseValidationError` if it does not pass: FastAPI's
    500) and dumped to JSON by it; without a model, FastAPI's JSON encoding."""
    if isinstance(result, Response):
        return result
    route = direct.route
    status = route.status_code or 200
    if direct.response is None:
        return JSONResponse(jsonable_encoder(result), status_code=status)
    try:
        value = direct.response.validate_python(result, from_attributes=True)
    except ValidationError as e:
        raise ResponseValidationError(e.errors(include_url=False), body=result) from e
    content = direct.response.dump_json(
        value,
        by_alias=route.response_model_by_alias,
        exclude_unset=route.response_model_exclude_unset,
        exclude_defaults=route.response_model_exclude_defaults,
        exclude_none=route.response_model_exclude_none,
    )
    return Response(content, status_code=status, media_type="application/json")


def _handler(app: _ExceptionHandlers, exc: Exception) -> Handler | None:
    """The app's exception handler of `exc` (by its class's MRO, as Starlette looks it up;
    Exception itself is the server-error middleware's)."""
    for cls in type(exc).__mro__:
        if cls in app.exception_handlers and cls is not Exception:
            return app.exception_handlers[cls]
    return None
