"""`FutureReply` -> the HTTP answer of `retrieve_future` (tinker-protocol.md §2.4).

* not ready     -> 200 JSON `{"type": "try_again", "request_id", "queue_state"}`
* failed        -> 200 JSON `{"error": msg, "category": "user"|"server"|"unknown"}`
* a result    -> its op's answer (`gateway/ops/`: protobuf for forward_backward and sample,
                 JSON shaped as the SDK's response type for the others)

and `RetrieveFuturesReply` / `CancelFutureReply` -> retrieve_futures / cancel_future (§2.6-2.7).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from fastapi import Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from lockstep.gateway.schema import responses as rs
from lockstep.v1 import scheduler_pb2 as pb

PROTOBUF = "application/x-protobuf"

QueueState = Literal["active", "paused_capacity", "paused_rate_limit"]
_QUEUE_STATES: tuple[QueueState, ...] = ("active", "paused_capacity", "paused_rate_limit")
Category = Literal["user", "server", "unknown"]
_CATEGORIES: tuple[Category, ...] = ("user", "server", "unknown")


def json_response(model: BaseModel, status_code: int = 200) -> JSONResponse:
    return JSONResponse(model.model_dump(mode="json"), status_code=status_code)


def try_again(request_id: str, queue_state: str = "active", reason: str = "") -> JSONResponse:
    state = queue_state if queue_state in _QUEUE_STATES else "active"
    return json_response(
        rs.TryAgainResponse(
            request_id=request_id, queue_state=state, queue_state_reason=reason or None
        )
    )


def failed(message: str, category: str) -> JSONResponse:
    cat = category if category in _CATEGORIES else "unknown"
    return json_response(rs.RequestFailedResponse(error=message or "request failed", category=cat))


def result_response(result: pb.JobResult) -> Response:
    """The results of calls that are not ops (`gateway/ops/` answers the ops' own)."""
    kind = result.WhichOneof("result")
    if kind == "unload_model":
        return json_response(rs.UnloadModelResult(model_id=result.unload_model.model_id))
    if kind == "custom_loss":
        return json_response(rs.CreateCustomLossResponse(loss_id=result.custom_loss.loss_id))
    return failed("the scheduler returned an empty result", "server")


def future_response(
    request_id: str,
    reply: pb.FutureReply,
    answer: Callable[[pb.JobResult], Response | None] = lambda result: None,
) -> Response:
    """`answer`: an op's own rendering of its result (None: not an op's result)."""
    state = reply.WhichOneof("state")
    if state == "try_again":
        return try_again(request_id, reply.try_again.queue_state, reply.try_again.reason)
    if state == "error":
        return failed(reply.error.message, reply.error.category)
    if state == "result":
        return answer(reply.result) or result_response(reply.result)
    return failed("the scheduler returned an empty future reply", "server")


def completions(reply: pb.RetrieveFuturesReply) -> rs.FuturesRetrieveResponse:
    return rs.FuturesRetrieveResponse(
        completions=[
            rs.FutureFailed(request_id=c.request_id)
            if c.failed
            else rs.FutureFinished(
                request_id=c.request_id, response_payload_uncompressed_size=c.payload_size
            )
            for c in reply.completions
        ],
        cursor=reply.cursor,
    )


_CANCEL_OUTCOMES: dict[int, rs.CancelOutcome] = {
    pb.CANCEL_OUTCOME_CANCELLED: "cancelled",
    pb.CANCEL_OUTCOME_ALREADY_FINISHED: "already_finished",
    pb.CANCEL_OUTCOME_ALREADY_FAILED: "already_failed",
}


def cancel_outcome(reply: pb.CancelFutureReply) -> rs.CancelOutcome:
    if reply.outcome not in _CANCEL_OUTCOMES:
        raise ValueError(f"the scheduler answered an unknown cancel outcome {reply.outcome}")
    return _CANCEL_OUTCOMES[reply.outcome]
