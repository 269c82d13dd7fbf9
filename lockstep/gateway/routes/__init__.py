"""HTTP routes, one module per resource (FastAPI full-stack template layout)."""

from __future__ import annotations

from fastapi import APIRouter

from lockstep.gateway.routes import client, files, futures, runs, sampling, sessions, training

api_router = APIRouter()
api_router.include_router(client.health_router)
api_router.include_router(client.router)
api_router.include_router(sessions.router)
api_router.include_router(training.router)
api_router.include_router(sampling.router)
api_router.include_router(futures.router)
api_router.include_router(runs.router)
api_router.include_router(files.router)
