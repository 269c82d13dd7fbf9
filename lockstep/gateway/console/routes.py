"""`/console`: the pages (a shell that holds no data) and the views they load with the key.

The shell asks for the API key in a form and keeps it in the tab's session storage; every view
is then fetched with it in the `X-API-Key` header, authenticated by the same dependency as the
API (a key never travels in a URL, and a cookie-less header cannot be forged cross-site). Views
are HTML rendered here from the API's own route functions (`views.py`).
"""

from __future__ import annotations

from collections.abc import Awaitable
from pathlib import Path
from typing import Annotated, Any

import grpc
import jinja2
from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import HTMLResponse, Response

from lockstep.gateway.console import chart, views
from lockstep.gateway.console.clock import ClockWatch
from lockstep.gateway.deps import Caller, Scheduler, require_caller
from lockstep.gateway.errors import ApiError, rpc_error_to_api_error

HERE = Path(__file__).parent
STATIC = {  # everything the console loads besides its HTML: no other asset, no CDN
    "console.js": "text/javascript; charset=utf-8",
    "console.css": "text/css; charset=utf-8",
}
HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
        "object-src 'none'; base-uri 'none'; frame-ancestors 'none'; form-action 'self'"
    ),
    "Referrer-Policy": "no-referrer",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-store",
}
PAGES = {  # a page's path -> the view it loads
    "runs": "/console/view/runs",
    "usage": "/console/view/usage",
    "playground": "/console/view/playground",
}

templates = jinja2.Environment(
    loader=jinja2.FileSystemLoader(HERE / "templates"),
    autoescape=True,
    undefined=jinja2.StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
)
templates.filters["num"] = chart.fmt
templates.filters["bytes"] = lambda n: f"{(n or 0) / 1e6:.1f} MB"
templates.filters["time"] = lambda t: t.strftime("%Y-%m-%d %H:%M:%S UTC") if t else "-"

router = APIRouter(prefix="/console", include_in_schema=False)
CallerOf = Annotated[Caller, Depends(require_caller)]


def _html(name: str, code: int = 200, **context: Any) -> HTMLResponse:
    body = templates.get_template(name).render(**context)
    return HTMLResponse(body, status_code=code, headers=HEADERS)


async def _view(name: str, read: Awaitable[dict[str, Any]]) -> HTMLResponse:
    """A view rendered from what the API answered; an API error is the view's own status
    (404 for another key's run, as the API answers), shown in the page."""
    try:
        context = await read
    except grpc.aio.AioRpcError as exc:
        err = rpc_error_to_api_error(exc)
        return _html("error.html", err.status_code, status=err.status_code, detail=err.detail)
    except ApiError as exc:
        return _html("error.html", exc.status_code, status=exc.status_code, detail=exc.detail)
    return _html(name, **context)


def _clock(request: Request) -> ClockWatch:
    watch: ClockWatch | None = getattr(request.app.state, "console_clock", None)
    if watch is None:
        watch = ClockWatch(request.app.state.settings.scheduler_metrics_url)
        request.app.state.console_clock = watch
    return watch


# ---------------------------------------------------------------- pages (no data, no key)
@router.get("")
async def home() -> HTMLResponse:
    return _html("shell.html", view=PAGES["runs"], page="runs")


@router.get("/runs/{run_id}")
async def run_shell(run_id: str) -> HTMLResponse:
    return _html("shell.html", view=f"/console/view/runs/{run_id}", page="run")


@router.get("/{page}")
async def page_shell(page: str) -> HTMLResponse:
    if page not in PAGES:
        return _html("shell.html", 404, view="", page="missing")
    return _html("shell.html", view=PAGES[page], page=page)


@router.get("/static/{name}")
async def static(name: str) -> Response:
    if name not in STATIC:
        return Response(status_code=404)
    headers = {**HEADERS, "Cache-Control": "no-cache"}
    return Response((HERE / "static" / name).read_bytes(), media_type=STATIC[name], headers=headers)


# ---------------------------------------------------------------- views (X-API-Key)
@router.get("/view/runs")
async def runs_view(caller: CallerOf, stub: Scheduler, offset: int = Query(0, ge=0)) -> Response:
    return await _view("runs.html", views.runs_page(caller, stub, offset))


@router.get("/view/runs/{run_id}")
async def run_view(run_id: str, caller: CallerOf, stub: Scheduler) -> Response:
    return await _view("run.html", views.run_page(caller, stub, run_id))


@router.get("/view/runs/{run_id}/live")
async def run_live_view(run_id: str, caller: CallerOf, stub: Scheduler) -> Response:
    return await _view("run_live.html", views.run_live(caller, stub, run_id))


@router.get("/view/usage")
async def usage_view(request: Request, caller: CallerOf, stub: Scheduler) -> Response:
    return await _view("usage.html", views.usage_page(request, caller, stub))


@router.get("/view/playground")
async def playground_view(caller: CallerOf, stub: Scheduler) -> Response:
    return await _view("playground.html", views.playground_page(caller, stub))


@router.get("/view/clock")
async def clock_view(request: Request, caller: CallerOf) -> Response:
    return await _view("clock.html", views.clock_panel(_clock(request)))
