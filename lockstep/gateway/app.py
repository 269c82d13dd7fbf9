"""The gateway application: `create_app(settings)` and `run_gateway(settings, host, port)`."""

from __future__ import annotations

import asyncio
import logging
import secrets
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc
import uvicorn
from fastapi import FastAPI

from lockstep import grpc_options, runtime
from lockstep.gateway.answers import Answers
from lockstep.gateway.body import BodyLimitMiddleware
from lockstep.gateway.console.routes import router as console_router
from lockstep.gateway.direct import DirectRoutes, hot_routes
from lockstep.gateway.errors import install_error_handlers
from lockstep.gateway.inference.lane import new_sessions
from lockstep.gateway.openapi import install_openapi
from lockstep.gateway.ops import registry
from lockstep.gateway.refusals import RefusalMiddleware
from lockstep.gateway.routes import routers
from lockstep.gateway.settings import GatewaySettings
from lockstep.gateway.stub import TimedStub
from lockstep.keyring import KeyRing
from lockstep.observability.asgi import MetricsMiddleware, metrics_endpoint

log = logging.getLogger("lockstep.gateway")


def create_app(settings: GatewaySettings, direct: bool = True) -> FastAPI:
    """The FastAPI app; its lifespan opens (and closes) the grpc.aio channel to the scheduler.
    `direct` False leaves the hot routes to FastAPI too (what the direct layer is compared
    with: tests/unit/test_gateway_direct.py)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        channel = grpc.aio.insecure_channel(
            settings.scheduler_address,
            options=grpc_options.channel_options(settings.grpc_max_message_bytes),
        )
        app.state.scheduler = TimedStub(channel)
        log.info("gateway: scheduler channel open to %s", settings.scheduler_address)
        if settings.keys_file is not None:  # SIGHUP: re-read the keys file (add, revoke)
            try:
                asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, reload_keys)
            except (RuntimeError, ValueError):  # not the main thread (an in-process test app)
                log.warning("gateway: no SIGHUP handler here; keys file reload disabled")
        try:
            yield
        finally:
            await channel.close()
            log.info("gateway: scheduler channel to %s closed", settings.scheduler_address)

    def reload_keys() -> None:
        assert settings.keys_file is not None
        try:
            app.state.keyring = KeyRing.load(settings.keys_file)
        except ValueError as exc:  # a typo must not lock everyone out: keep the old keys
            log.error("gateway: keys file not reloaded: %s", exc)
            return
        log.info(
            "gateway: %d keys loaded from %s", len(app.state.keyring.entries), settings.keys_file
        )

    if settings.api_keys and settings.allow_any_tml_key:
        log.warning("gateway: API keys are configured, so --allow-any-tml-key is ignored")
    if not settings.api_keys and not settings.allow_any_tml_key and not settings.keys_file:
        log.warning(
            "gateway: no API keys configured and --allow-any-tml-key off: all calls get 401"
        )
    secret = settings.file_url_secret
    if not secret:
        secret = secrets.token_bytes(32)
        log.warning("gateway: no file URL secret given; download URLs die with this process")

    app = FastAPI(
        title="Lockstep gateway",
        summary="Tinker HTTP API (/api/v1) in front of the Lockstep scheduler",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
    )
    app.state.settings = settings
    app.state.answers = Answers()
    app.state.reload_keys = reload_keys
    app.state.keyring = None
    if settings.keys_file is not None:
        app.state.keyring = KeyRing.load(settings.keys_file)  # a bad file stops the start
    app.state.file_url_secret = secret
    app.state.text_codec = None  # loaded on the first compatible-route request
    app.state.text_codec_lock = asyncio.Lock()
    app.state.compat_sessions = new_sessions()
    install_error_handlers(app)
    served = routers()
    for router in served:
        app.include_router(router)
    app.include_router(console_router)  # /console: the web console (no key in its pages)
    # bodies read by hand (forward_backward: protobuf or JSON)
    install_openapi(app, [m for op in registry.ops() for m in op.documented])
    app.add_api_route("/metrics", metrics_endpoint, include_in_schema=False)  # no key: scrapers
    app.add_middleware(DirectRoutes, routes=hot_routes(*served) if direct else [])  # innermost
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=settings.max_body_bytes)
    app.add_middleware(RefusalMiddleware)  # outside the body limit: it reports that one's 413s
    app.add_middleware(MetricsMiddleware)  # outermost: times everything
    return app


def run_gateway(
    settings: GatewaySettings, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info"
) -> None:
    """Serve the gateway with uvicorn until interrupted."""
    app = create_app(settings)
    log.info(
        "gateway: starting the Tinker API on http://%s:%d/api/v1 (scheduler at %s)",
        host,
        port,
        settings.scheduler_address,
    )
    # Keep idle HTTP/1.1 connections open longer than the SDK's pool does, so the client is
    # the side that closes them (a server-side close races with request reuse).
    if log_level != "debug":
        logging.getLogger("uvicorn.access").addFilter(_failed_calls_only)
    runtime.settle_heap()
    uvicorn.run(
        app,
        host=host,
        port=port,
        log_level=log_level,
        timeout_keep_alive=75,
        loop="uvloop",
        http="httptools",
    )


def _failed_calls_only(record: logging.LogRecord) -> bool:
    """The access log's lines of failed calls (4xx, 5xx) only: a line per call cost ~5 % of the
    gateway's CPU (the SDK polls all the time), and every call is counted and timed in /metrics.
    --log-level debug logs them all."""
    args = record.args
    status = args[-1] if isinstance(args, tuple) and args else None
    return not isinstance(status, int) or status >= 400
