"""optim_step: the model's step with AdamW parameters (sent as `adam_params`, or as a
family-tagged `optimizer_params` / `optim_params`)."""

from __future__ import annotations

from typing import ClassVar

from fastapi import Response

from lockstep.gateway.ops.base import GatewayOp
from lockstep.gateway.schema import responses as rs
from lockstep.gateway.schema.requests import SchemaModel
from lockstep.gateway.translate.futures import json_response
from lockstep.gateway.validate import as_bad_request, check_id, check_seq_id
from lockstep.v1 import scheduler_pb2 as pb
from lockstep.vocab import Optimizer


class OptimParams(SchemaModel):
    """AdamParams (`adam_params`) or a family-tagged `optimizer_params` / `optim_params`."""

    type: str | None = None
    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


class OptimStepRequest(SchemaModel):
    model_id: str
    seq_id: int | None = None
    adam_params: OptimParams | None = None
    optimizer_params: OptimParams | None = None
    optim_params: OptimParams | None = None


class OptimStep(GatewayOp):
    name = "optim_step"
    path = "/api/v1/optim_step"
    tag = "training"
    oneof = "optim_step"
    result = "optim_step"
    sequenced = True
    hot = True
    body: ClassVar[type[OptimStepRequest]] = OptimStepRequest

    async def submit_request(self, owner: str, body: OptimStepRequest) -> pb.SubmitRequest:
        step = pb.OptimStep(
            model_id=check_id("model_id", body.model_id), seq_id=check_seq_id(body.seq_id)
        )
        for field in ("adam_params", "optimizer_params", "optim_params"):
            params: OptimParams | None = getattr(body, field)
            if params is not None:
                if params.type is not None:  # the contract carries AdamW steps only
                    with as_bad_request():
                        Optimizer.named(f"{field}.type", params.type)
                step.adam.CopyFrom(pb.AdamParams(**params.model_dump(exclude={"type"})))
                break
        return pb.SubmitRequest(owner=owner, optim_step=step)

    def answer(self, result: pb.JobResult, request_type: str | None) -> Response:
        return json_response(rs.OptimStepResult(metrics=dict(result.optim_step.metrics)))
