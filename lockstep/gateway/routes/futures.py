"""Futures: `retrieve_future` (the long-poll every future goes through), `retrieve_futures`
(a sampling session's completions, for the SDK's session poller) and `cancel_future`."""

from __future__ import annotations

import asyncio
from typing import Annotated

import grpc
from fastapi import APIRouter, Header, Response

from lockstep.gateway.deps import CALL_TIMEOUT_S, Owner, Prefetched, Scheduler, Settings
from lockstep.gateway.direct import HotRoute
from lockstep.gateway.ops import registry
from lockstep.gateway.schema import requests as rq
from lockstep.gateway.schema import responses as rs
from lockstep.gateway.translate import futures as tr
from lockstep.gateway.validate import check_id
from lockstep.v1 import scheduler_pb2 as pb

router = APIRouter(prefix="/api/v1", tags=["futures"])
# What every hot op's future is answered through: served by the direct layer too.
hot_router = APIRouter(prefix="/api/v1", tags=["futures"], route_class=HotRoute)

# The SDK gives up on one retrieve_future(s) call after 45 s.
_SDK_TIMEOUT_S = 45.0
# Pause before reporting an unreachable scheduler: the SDK re-polls a 5xx immediately.
UNAVAILABLE_PAUSE_S = 1.0


def _deadline(wait: float) -> float:
    return min(wait + 5.0, _SDK_TIMEOUT_S - 2.0)


@hot_router.post("/retrieve_future", response_model=None)
async def retrieve_future(
    body: rq.FutureRetrieveRequest,
    owner: Owner,
    stub: Scheduler,
    settings: Settings,
    prefetched: Prefetched,
    request_type: Annotated[str | None, Header(alias="X-Tinker-Request-Type")] = None,
) -> Response:
    """Hold the call until the result is ready or `long_poll_seconds` pass (then try_again).

    `allow_metadata_only` is ignored: the payload is always sent. A sample whose answer this
    gateway's session poll brought along is answered from it.
    """
    request_id = check_id("request_id", body.request_id)
    wait = settings.long_poll_seconds
    reply = prefetched.take(owner, request_id)
    if reply is not None:
        return tr.future_response(
            request_id, reply, lambda result: registry.answer(result, request_type)
        )
    try:
        reply = await stub.RetrieveFuture(
            pb.RetrieveFutureRequest(owner=owner, request_id=request_id, timeout_seconds=wait),
            timeout=_deadline(wait),
        )
    except grpc.aio.AioRpcError as e:
        if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            return tr.try_again(request_id)
        if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return tr.try_again(request_id, "paused_capacity")
        if e.code() == grpc.StatusCode.UNAVAILABLE:
            await asyncio.sleep(UNAVAILABLE_PAUSE_S)
        raise
    return tr.future_response(
        request_id, reply, lambda result: registry.answer(result, request_type)
    )


@hot_router.post("/retrieve_futures")
async def retrieve_futures(
    body: rq.FuturesRetrieveRequest,
    owner: Owner,
    stub: Scheduler,
    settings: Settings,
    prefetched: Prefetched,
) -> rs.FuturesRetrieveResponse:
    """The sampling session's (clone's) samples finished or failed since `prev_cursor`, held
    until there is one or the long-poll (`timeout`, at most `long_poll_seconds`) runs out.

    Each sample completes here once; the SDK then fetches its payload with retrieve_future.
    """
    target = body.target
    sampler_id = check_id("target.sampling_session_id", target.sampling_session_id)
    wait = settings.long_poll_seconds
    if body.timeout is not None:
        wait = min(wait, body.timeout)
    request = pb.RetrieveFuturesRequest(
        owner=owner,
        sampler_id=sampler_id,
        clone=target.cloned_sampler_id,
        prev_cursor=body.prev_cursor,
        timeout_seconds=wait,
    )
    try:
        reply = await stub.RetrieveFutures(request, timeout=_deadline(wait))
    except grpc.aio.AioRpcError as e:
        if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:  # nothing new: poll again
            return rs.FuturesRetrieveResponse(completions=[], cursor=body.prev_cursor)
        if e.code() == grpc.StatusCode.UNAVAILABLE:
            await asyncio.sleep(UNAVAILABLE_PAUSE_S)
        raise
    prefetched.keep(owner, reply.completions)  # their retrieve_future calls come next
    return tr.completions(reply)


@router.post("/cancel_future")
async def cancel_future(
    body: rq.CancelFutureRequest, owner: Owner, stub: Scheduler
) -> rs.CancelFutureResponse:
    """Cancel a sample: a queued one never runs, and its future answers a "cancelled" error.

    A finished one keeps its outcome (200, saying so); an unknown id is a 404 and a training
    request a 400 (its model runs its requests in seq_id order).
    """
    request_id = check_id("request_id", body.request_id)
    reply = await stub.CancelFuture(
        pb.CancelFutureRequest(owner=owner, request_id=request_id), timeout=CALL_TIMEOUT_S
    )
    return rs.CancelFutureResponse(request_id=request_id, outcome=tr.cancel_outcome(reply))
