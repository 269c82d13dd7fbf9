"""Training runs' calls that are not submissions: get_info, unload_model. The submissions
(create_model, forward_backward, optim_step, save/load weights) are ops, `gateway/ops/`."""

from __future__ import annotations

from fastapi import APIRouter

from lockstep.gateway.deps import CALL_TIMEOUT_S, Owner, Scheduler
from lockstep.gateway.ops.base import future
from lockstep.gateway.schema import requests as rq
from lockstep.gateway.schema import responses as rs
from lockstep.gateway.translate import training as tr
from lockstep.gateway.validate import check_id
from lockstep.v1 import scheduler_pb2 as pb

router = APIRouter(prefix="/api/v1", tags=["training"])


@router.post("/unload_model")
async def unload_model(
    body: rq.UnloadModelRequest, owner: Owner, stub: Scheduler
) -> rs.UntypedAPIFuture:
    """Frees the model's engine state now (older SDKs); a later request re-hydrates it."""
    ref = pb.ModelRef(owner=owner, model_id=check_id("model_id", body.model_id))
    return future(await stub.UnloadModel(ref, timeout=CALL_TIMEOUT_S))


@router.post("/get_info")
async def get_info(body: rq.GetInfoRequest, owner: Owner, stub: Scheduler) -> rs.GetInfoResponse:
    ref = pb.ModelRef(owner=owner, model_id=check_id("model_id", body.model_id))
    return tr.model_info(await stub.GetModelInfo(ref, timeout=CALL_TIMEOUT_S))
