"""OpenAI-compatible `GET /oai/api/v1/models`: the served base models and the caller's sampler
checkpoints (any `tinker://` path the caller may read also works as a `model`)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from lockstep.gateway.deps import CALL_TIMEOUT_S, BearerOwner, Scheduler
from lockstep.gateway.inference import lane
from lockstep.gateway.inference.errors import compat_route, openai_error
from lockstep.v1 import scheduler_pb2 as pb

router = APIRouter(prefix="/oai/api/v1", tags=["openai"], route_class=compat_route(openai_error))

_MAX_LISTED = 1000


def _model(model_id: str, created: int, owned_by: str) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": created, "owned_by": owned_by}


@router.get("/models")
async def list_models(owner: BearerOwner, stub: Scheduler) -> dict[str, Any]:
    data = [_model(name, 0, "lockstep") for name in await lane.served_models(stub)]
    listing = await stub.ListCheckpoints(
        pb.ListCheckpointsRequest(owner=owner, limit=_MAX_LISTED), timeout=CALL_TIMEOUT_S
    )
    for ckpt in listing.checkpoints:
        if ckpt.checkpoint_type == "sampler":
            data.append(_model(ckpt.tinker_path, int(ckpt.time), owner))
    return {"object": "list", "data": data}
