"""`FutureReply` -> the HTTP answer of `retrieve_future` (tinker-protocol.md §2.4).

* not ready     -> 200 JSON `{"type": "try_again", "request_id", "queue_state"}`
* failed        -> 200 JSON `{"error": msg, "category": "user"|"server"|"unknown"}`
* fwd/bwd, sample results -> 200 `application/x-protobuf` bytes of the wire message
* other results -> 200 JSON shaped as the SDK's response type for that request

and `RetrieveFuturesReply` / `CancelFutureReply` -> retrieve_futures / cancel_future (§2.6-2.7).
"""

from __future__ import annotations

from typing import Literal

from fastapi import Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from lockstep.gateway.schema import responses as rs
from lockstep.gateway.translate.common import optional_str
from lockstep.v1 import scheduler_pb2 as pb

PROTOBUF = "application/x-protobuf"

QueueState = Literal["active", "paused_capacity", "paused_rate_limit"]
_QUEUE_STATES: tuple[QueueState, ...] = ("active", "paused_capacity", "paused_rate_limit")
Category = Literal["user", "server", "unknown"]
_CATEGORIES: tuple[Category, ...] = ("user", "server", "unknown")

# `X-Tinker-Request-Type` header of retrieve_future -> the `type` literal of the save result.
_SAVE_TYPE_BY_HEADER = {
    "SaveWeights": "save_weights",
    "SaveWeightsForSampler": "save_weights_for_sampler",
    "SaveWeightsExternal": "save_weights_external",
}


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


def _save_kind(save: pb.SaveResult, request_type: str | None) -> str:
    """Which save request this result answers: the SaveResult itself does not say.

    The SDK names it in `X-Tinker-Request-Type`; without that header, the checkpoint path's
    segment (or an ephemeral sampler id) tells.
    """
    if request_type in _SAVE_TYPE_BY_HEADER:
        return _SAVE_TYPE_BY_HEADER[request_type]
    path = save.path if save.HasField("path") else ""
    if save.HasField("sampling_session_id") or "/sampler_weights/" in path:
        return "save_weights_for_sampler"
    if "/external_weights/" in path:
        return "save_weights_external"
    return "save_weights"


def _save_result(save: pb.SaveResult, request_type: str | None) -> BaseModel:
    path = save.path if save.HasField("path") else None
    kind = _save_kind(save, request_type)
    if kind == "save_weights_for_sampler":
        session = save.sampling_session_id if save.HasField("sampling_session_id") else None
        return rs.SaveWeightsForSamplerResult(path=path, sampling_session_id=session)
    if kind == "save_weights_external":
        return rs.SaveWeightsExternalResult(path=path or "", size_bytes=save.size_bytes or None)
    return rs.SaveWeightsResult(path=path or "")


def result_response(result: pb.JobResult, request_type: str | None = None) -> Response:
    kind = result.WhichOneof("result")
    if kind == "forward_backward":
        return Response(result.forward_backward.SerializeToString(), media_type=PROTOBUF)
    if kind == "sample":
        return Response(result.sample.SerializeToString(), media_type=PROTOBUF)
    if kind == "create_model":
        return json_response(rs.CreateModelResult(model_id=result.create_model.model_id))
    if kind == "unload_model":
        return json_response(rs.UnloadModelResult(model_id=result.unload_model.model_id))
    if kind == "custom_loss":
        return json_response(rs.CreateCustomLossResponse(loss_id=result.custom_loss.loss_id))
    if kind == "optim_step":
        return json_response(rs.OptimStepResult(metrics=dict(result.optim_step.metrics)))
    if kind == "save":
        return json_response(_save_result(result.save, request_type))
    if kind == "load":
        load = result.load
        return json_response(
            rs.LoadWeightsResult(path=optional_str(load.path), model_id=optional_str(load.model_id))
        )
    return failed("the scheduler returned an empty result", "server")


def future_response(
    request_id: str, reply: pb.FutureReply, request_type: str | None = None
) -> Response:
    state = reply.WhichOneof("state")
    if state == "try_again":
        return try_again(request_id, reply.try_again.queue_state, reply.try_again.reason)
    if state == "error":
        return failed(reply.error.message, reply.error.category)
    if state == "result":
        return result_response(reply.result, request_type)
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
