"""HTTP routes, one module per resource (FastAPI full-stack template layout); the routes of the
submissions are built from the op registry (`gateway/ops/`)."""

from __future__ import annotations

from fastapi import APIRouter

from lockstep.gateway.ops import registry
from lockstep.gateway.routes import (
    accounting,
    anthropic_messages,
    client,
    files,
    futures,
    oai_chat,
    oai_completions,
    oai_models,
    runs,
    sampling,
    sessions,
    traces,
    training,
)


def routers() -> tuple[APIRouter, ...]:
    """Every router, in the order the app includes them; the ops' from the registry as it is
    now. The hot routes among them (`direct.hot_routes`) are served by the direct layer too."""
    return (
        client.health_router,
        client.router,
        sessions.router,
        registry.router(),
        training.router,
        sampling.router,
        futures.hot_router,
        futures.router,
        runs.router,
        files.router,
        oai_completions.router,
        oai_chat.router,
        oai_models.router,
        anthropic_messages.router,
        accounting.router,
        traces.router,
    )
