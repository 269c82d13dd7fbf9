"""Training: create_model, get_info, forward_backward, optim_step, save/load weights.

Every submission answers at once with a future (`{"request_id", "model_id"}`); the work is
the scheduler's, and its result comes back through `retrieve_future`. A refused request with a
seq_id is reported to the scheduler on its way out (lockstep.gateway.refusals), not here.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from lockstep.gateway.deps import CALL_TIMEOUT_S, KeyQuota, Owner, Scheduler
from lockstep.gateway.openapi import body_ref
from lockstep.gateway.refusals import is_json
from lockstep.gateway.schema import requests as rq
from lockstep.gateway.schema import responses as rs
from lockstep.gateway.translate import training as tr
from lockstep.gateway.validate import check_id
from lockstep.v1 import scheduler_pb2 as pb

router = APIRouter(prefix="/api/v1", tags=["training"])


async def submit(stub: Any, request: pb.SubmitRequest) -> rs.UntypedAPIFuture:
    return tr.future(await stub.Submit(request, timeout=CALL_TIMEOUT_S))


@router.post("/create_model")
async def create_model(
    body: rq.CreateModelRequest, owner: Owner, quota: KeyQuota, stub: Scheduler
) -> rs.UntypedAPIFuture:
    request = tr.create_model(owner, body)
    request.key_max_training_runs = quota  # the keys file's per-key quota, if any
    return await submit(stub, request)


@router.post("/unload_model")
async def unload_model(
    body: rq.UnloadModelRequest, owner: Owner, stub: Scheduler
) -> rs.UntypedAPIFuture:
    """Frees the model's engine state now (older SDKs); a later request re-hydrates it."""
    ref = pb.ModelRef(owner=owner, model_id=check_id("model_id", body.model_id))
    return tr.future(await stub.UnloadModel(ref, timeout=CALL_TIMEOUT_S))


@router.post("/get_info")
async def get_info(body: rq.GetInfoRequest, owner: Owner, stub: Scheduler) -> rs.GetInfoResponse:
    ref = pb.ModelRef(owner=owner, model_id=check_id("model_id", body.model_id))
    return tr.model_info(await stub.GetModelInfo(ref, timeout=CALL_TIMEOUT_S))


@router.post(
    "/forward_backward",
    openapi_extra=body_ref(
        rq.ForwardBackwardJsonRequest,
        protobuf="tinker.ForwardBackwardRequest (the SDK's form), "
        "optionally zstd/gzip-compressed (Content-Encoding)",
    ),
)
async def forward_backward(request: Request, owner: Owner, stub: Scheduler) -> rs.UntypedAPIFuture:
    """Body: protobuf `ForwardBackwardRequest` (what the SDK sends; zstd already undone by the
    body middleware) or, for robustness, its JSON form."""
    body = await request.body()
    if is_json(request.headers.get("content-type")):
        try:
            parsed = rq.ForwardBackwardJsonRequest.model_validate_json(body)
        except ValidationError as e:
            raise RequestValidationError(e.errors()) from e
        return await submit(stub, tr.forward_backward_from_json(owner, parsed))
    return await submit(stub, tr.forward_backward_from_proto(owner, body))


@router.post("/optim_step")
async def optim_step(
    body: rq.OptimStepRequest, owner: Owner, stub: Scheduler
) -> rs.UntypedAPIFuture:
    return await submit(stub, tr.optim_step(owner, body))


@router.post("/save_weights")
async def save_weights(
    body: rq.SaveWeightsRequest, owner: Owner, stub: Scheduler
) -> rs.UntypedAPIFuture:
    return await submit(stub, tr.save_weights(owner, body))


@router.post("/save_weights_for_sampler")
async def save_weights_for_sampler(
    body: rq.SaveWeightsForSamplerRequest, owner: Owner, stub: Scheduler
) -> rs.UntypedAPIFuture:
    return await submit(stub, tr.save_weights_for_sampler(owner, body))


@router.post("/save_weights_external")
async def save_weights_external(
    body: rq.SaveWeightsExternalRequest, owner: Owner, stub: Scheduler
) -> rs.UntypedAPIFuture:
    return await submit(stub, tr.save_weights_external(owner, body))


@router.post("/load_weights")
async def load_weights(
    body: rq.LoadWeightsRequest, owner: Owner, quota: KeyQuota, stub: Scheduler
) -> rs.UntypedAPIFuture:
    request = tr.load_weights(owner, body)
    request.key_max_training_runs = quota  # create-via-load makes a run too
    return await submit(stub, request)
