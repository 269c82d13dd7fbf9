"""What a contributor writes as lockstep/gateway/ops/sgd_step.py (and a line in
lockstep/gateway/ops/registry.py's OPS: the test registers it for its block)."""

from __future__ import annotations

from typing import ClassVar

from fastapi import Response

from lockstep.gateway.ops.base import GatewayOp
from lockstep.gateway.schema.requests import SchemaModel
from lockstep.gateway.translate.futures import json_response
from lockstep.gateway.validate import check_id, check_seq_id
from lockstep.v1 import scheduler_pb2 as pb


class SgdStepRequest(SchemaModel):
    model_id: str
    seq_id: int | None = None
    learning_rate: float


class SgdStepResponse(SchemaModel):
    grad_norm: float


class SgdStep(GatewayOp):
    """A plain SGD step of the model's accumulated gradients."""

    name, path, tag = "sgd_step", "/api/v1/sgd_step", "training"
    oneof = result = "sgd_step"  # its SubmitRequest and JobResult fields
    sequenced = True  # it takes a seq_id of its model
    body: ClassVar[type[SgdStepRequest]] = SgdStepRequest

    async def submit_request(self, owner: str, body: SgdStepRequest) -> pb.SubmitRequest:
        step = pb.SgdStep(  # the address is the gateway's to check; the rules are not
            model_id=check_id("model_id", body.model_id),
            seq_id=check_seq_id(body.seq_id),
            learning_rate=body.learning_rate,
        )
        return pb.SubmitRequest(owner=owner, sgd_step=step)

    def answer(self, result: pb.JobResult, request_type: str | None) -> Response:
        return json_response(SgdStepResponse(grad_norm=result.sgd_step.grad_norm))
