"""`POST /api/v1/retrieve_future`: the long-poll every future goes through."""

from __future__ import annotations

import asyncio
from typing import Annotated

import grpc
from fastapi import APIRouter, Header, Response

from lockstep.gateway.deps import Owner, Scheduler, Settings
from lockstep.gateway.translate import futures as tr
from lockstep.gateway.validate import check_id
from lockstep.gateway.wire import requests as rq
from lockstep.v1 import scheduler_pb2 as pb

router = APIRouter(prefix="/api/v1", tags=["futures"])

# The SDK gives up on one retrieve_future call after 45 s.
_SDK_TIMEOUT_S = 45.0
# Pause before reporting an unreachable scheduler: the SDK re-polls a 5xx immediately.
UNAVAILABLE_PAUSE_S = 1.0


@router.post("/retrieve_future", response_model=None)
async def retrieve_future(
    body: rq.FutureRetrieveRequest,
    owner: Owner,
    stub: Scheduler,
    settings: Settings,
    request_type: Annotated[str | None, Header(alias="X-Tinker-Request-Type")] = None,
) -> Response:
    """Hold the call until the result is ready or `long_poll_seconds` pass (then try_again).

    `allow_metadata_only` is ignored: the payload is always sent.
    """
    request_id = check_id("request_id", body.request_id)
    wait = settings.long_poll_seconds
    try:
        reply = await stub.RetrieveFuture(
            pb.RetrieveFutureRequest(owner=owner, request_id=request_id, timeout_seconds=wait),
            timeout=min(wait + 5.0, _SDK_TIMEOUT_S - 2.0),
        )
    except grpc.aio.AioRpcError as e:
        if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            return tr.try_again(request_id)
        if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return tr.try_again(request_id, "paused_capacity")
        if e.code() == grpc.StatusCode.UNAVAILABLE:
            await asyncio.sleep(UNAVAILABLE_PAUSE_S)
        raise
    return tr.future_response(request_id, reply, request_type)
