"""Client bootstrap (config, dynamic config, telemetry), health, and the API-key endpoint."""

from __future__ import annotations

import grpc
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from lockstep.gateway.deps import CALL_TIMEOUT_S, Owner, Scheduler
from lockstep.gateway.errors import ApiError
from lockstep.gateway.schema import responses as rs
from lockstep.gateway.translate.futures import json_response
from lockstep.v1 import scheduler_pb2 as pb
from lockstep.version import VERSION

HEALTH_TIMEOUT_S = 3.0

router = APIRouter(prefix="/api/v1", tags=["client"])
health_router = APIRouter(tags=["health"])


@router.post("/client/config")
async def client_config(request: Request, owner: Owner, stub: Scheduler) -> rs.ClientConfigResponse:
    # Plain X-API-Key auth, plain httpx transport; zstd fwd/bwd bodies as the settings say (any
    # body may be compressed anyway: see lockstep.gateway.body). The SDK chunks its fwd/bwd
    # batches below the server's limits, so a large batch never meets a 400 or a 413. Custom
    # losses are uploaded only where the training engine runs them (its capabilities, asked of
    # the scheduler: once per SDK client); elsewhere the SDK runs them itself.
    settings = request.app.state.settings
    caps = await stub.GetServerCapabilities(pb.CapabilitiesRequest(), timeout=CALL_TIMEOUT_S)
    return rs.ClientConfigResponse(
        proto_compress_fwdbwd=settings.proto_compress_fwdbwd,
        fwdbwd_max_chunk_len=min(1024, settings.max_datums_per_request),
        fwdbwd_max_chunk_bytes_count=min(5_000_000, settings.max_body_bytes // 2),
        custom_loss_server_side=caps.engines.custom_loss,
        sample_use_retrieve_futures=settings.sample_session_polling,
        sample_join_sampling_session=True,
    )


@router.post("/client/dynamic_config")
async def client_dynamic_config(owner: Owner) -> rs.ClientDynamicConfigResponse:
    return rs.ClientDynamicConfigResponse(sample_cancel_enabled=True)


@router.post("/telemetry")
async def telemetry(owner: Owner) -> rs.TelemetryResponse:
    return rs.TelemetryResponse()


@router.get("/auth/apikey/me")
async def api_key_me(owner: Owner) -> rs.ApiKeyMeResponse:
    """What `tinker auth login` checks a pasted key against."""
    return rs.ApiKeyMeResponse(
        key_id=0,
        name=f"lockstep key {owner}",
        note="API keys are configured by the operator of this Lockstep server",
        details=rs.ApiKeyDetails(
            org_details=rs.OrgDetails(name="lockstep"),
            user_details=rs.UserDetails(email=""),
        ),
    )


@router.delete("/auth/apikey/me")
async def revoke_api_key(owner: Owner) -> None:
    raise ApiError(
        400, "API keys are configured by the operator of this server and cannot be revoked here"
    )


@health_router.get("/healthz")
@health_router.get("/api/v1/healthz")
async def healthz(stub: Scheduler) -> JSONResponse:
    """200 {"status": "ok"} only when the scheduler says it (and what is behind it) is ready."""
    try:
        reply = await stub.Health(pb.Empty(), timeout=HEALTH_TIMEOUT_S)
    except grpc.aio.AioRpcError as e:
        parts = {"scheduler": f"unreachable ({e.code().name}): {e.details()}"}
        down = rs.HealthResponse(status="unavailable", parts=parts, version=VERSION)
        return json_response(down, 503)
    answer = rs.HealthResponse(
        status="ok" if reply.ready else "unavailable",
        parts=dict(reply.parts),
        version=VERSION,
        scheduler_version=reply.version or None,
        state_format=reply.state_format or None,
    )
    return json_response(answer, 200 if reply.ready else 503)
