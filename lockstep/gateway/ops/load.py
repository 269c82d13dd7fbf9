"""load_weights: a training checkpoint into a model (model_id + seq_id), or into a new one
(create-via-load: session_id + model_seq_id, the run's id computed by the SDK)."""

from __future__ import annotations

from typing import Any, ClassVar

from fastapi import Response

from lockstep.gateway.errors import bad_request
from lockstep.gateway.ops.base import GatewayOp
from lockstep.gateway.schema import responses as rs
from lockstep.gateway.schema.requests import Int32, OptimizerConfig, SchemaModel
from lockstep.gateway.translate.common import optional_str, str_map
from lockstep.gateway.translate.futures import json_response
from lockstep.gateway.validate import as_bad_request, check_id, check_seq_id
from lockstep.v1 import scheduler_pb2 as pb
from lockstep.vocab import Optimizer


class LoadWeightsRequest(SchemaModel):
    model_id: str | None = None
    seq_id: int | None = None
    session_id: str | None = None
    model_seq_id: Int32 | None = None
    base_model: str | None = None
    user_metadata: dict[str, Any] | None = None
    path: str
    optimizer: bool = False
    optimizer_config: OptimizerConfig | None = None
    weights_access_token: str | None = None


class LoadWeights(GatewayOp):
    name = "load_weights"
    path = "/api/v1/load_weights"
    tag = "training"
    oneof = "load_weights"
    result = "load"
    sequenced = True  # the legacy form; create-via-load holds no seq_id of a model
    body: ClassVar[type[LoadWeightsRequest]] = LoadWeightsRequest
    creates_run = True  # create-via-load makes a run too

    async def submit_request(self, owner: str, body: LoadWeightsRequest) -> pb.SubmitRequest:
        if body.optimizer_config is not None:  # the contract carries AdamW state only
            with as_bad_request():
                Optimizer.named("optimizer_config.type", body.optimizer_config.type)
        op = pb.LoadWeights(
            path=body.path,
            optimizer=body.optimizer,
            user_metadata=str_map(body.user_metadata),
            base_model=body.base_model or None,
        )
        if body.model_id is not None:
            op.model_id = check_id("model_id", body.model_id)
            op.seq_id = check_seq_id(body.seq_id)
        elif body.session_id is not None:
            op.session_id = check_id("session_id", body.session_id)
            if body.model_seq_id is None:
                raise bad_request("model_seq_id", "field required with session_id")
            op.model_seq_id = body.model_seq_id
        else:
            raise bad_request("model_id", "give model_id + seq_id, or session_id + model_seq_id")
        return pb.SubmitRequest(owner=owner, load_weights=op)

    def answer(self, result: pb.JobResult, request_type: str | None) -> Response:
        load = result.load
        return json_response(
            rs.LoadWeightsResult(path=optional_str(load.path), model_id=optional_str(load.model_id))
        )
