"""HTTP routes, one module per resource (FastAPI full-stack template layout)."""

from __future__ import annotations

from fastapi import APIRouter

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

api_router = APIRouter()
api_router.include_router(client.health_router)
api_router.include_router(client.router)
api_router.include_router(sessions.router)
api_router.include_router(training.router)
api_router.include_router(sampling.router)
api_router.include_router(futures.router)
api_router.include_router(runs.router)
api_router.include_router(files.router)
api_router.include_router(oai_completions.router)
api_router.include_router(oai_chat.router)
api_router.include_router(oai_models.router)
api_router.include_router(anthropic_messages.router)
api_router.include_router(accounting.router)
api_router.include_router(traces.router)
