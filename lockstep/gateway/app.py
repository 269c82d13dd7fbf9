"""The gateway application: `create_app(settings)` and `run_gateway(settings, host, port)`."""

from __future__ import annotations

import logging
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc
import uvicorn
from fastapi import FastAPI

from lockstep.gateway.body import BodyLimitMiddleware
from lockstep.gateway.errors import install_error_handlers
from lockstep.gateway.openapi import install_openapi
from lockstep.gateway.routes import api_router
from lockstep.gateway.settings import GatewaySettings
from lockstep.gateway.wire.requests import ForwardBackwardJsonRequest
from lockstep.observability.asgi import MetricsMiddleware, metrics_endpoint
from lockstep.v1 import scheduler_pb2_grpc

log = logging.getLogger("lockstep.gateway")


def _channel_options(settings: GatewaySettings) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", settings.grpc_max_message_bytes),
        ("grpc.max_receive_message_length", settings.grpc_max_message_bytes),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


def create_app(settings: GatewaySettings) -> FastAPI:
    """The FastAPI app; its lifespan opens (and closes) the grpc.aio channel to the scheduler."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        channel = grpc.aio.insecure_channel(
            settings.scheduler_address, options=_channel_options(settings)
        )
        app.state.scheduler = scheduler_pb2_grpc.SchedulerStub(channel)
        log.info("gateway: scheduler channel open to %s", settings.scheduler_address)
        try:
            yield
        finally:
            await channel.close()
            log.info("gateway: scheduler channel to %s closed", settings.scheduler_address)

    if settings.api_keys and settings.allow_any_tml_key:
        log.warning("gateway: API keys are configured, so --allow-any-tml-key is ignored")
    if not settings.api_keys and not settings.allow_any_tml_key:
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
    app.state.file_url_secret = secret
    install_error_handlers(app)
    app.include_router(api_router)
    install_openapi(app, [ForwardBackwardJsonRequest])  # bodies read by hand (protobuf/JSON)
    app.add_api_route("/metrics", metrics_endpoint, include_in_schema=False)  # no key: scrapers
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=settings.max_body_bytes)
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
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_keep_alive=75)
