"""create_model: a new training run (its id is computed by the SDK; no seq_id of a model)."""

from __future__ import annotations

from typing import Any, ClassVar

from fastapi import Response

from lockstep.gateway.ops.base import GatewayOp
from lockstep.gateway.schema import responses as rs
from lockstep.gateway.schema.requests import (
    Int32,
    Int64,
    OptimizerConfig,
    SchemaModel,
)
from lockstep.gateway.translate.common import str_map
from lockstep.gateway.translate.futures import json_response
from lockstep.gateway.validate import check_id
from lockstep.v1 import scheduler_pb2 as pb


class LoraConfig(SchemaModel):
    rank: Int32
    seed: Int64 | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class CreateModelRequest(SchemaModel):
    session_id: str
    model_seq_id: Int32
    base_model: str
    user_metadata: dict[str, Any] | None = None
    lora_config: LoraConfig | None = None
    optimizer_config: OptimizerConfig | None = None


class CreateModel(GatewayOp):
    name = "create_model"
    path = "/api/v1/create_model"
    tag = "training"
    oneof = "create_model"
    result = "create_model"
    sequenced = False
    body: ClassVar[type[CreateModelRequest]] = CreateModelRequest
    creates_run = True

    async def submit_request(self, owner: str, body: CreateModelRequest) -> pb.SubmitRequest:
        check_id("session_id", body.session_id)
        optimizer = body.optimizer_config
        op = pb.CreateModel(
            session_id=body.session_id,
            model_seq_id=body.model_seq_id,
            base_model=body.base_model,
            user_metadata=str_map(body.user_metadata),
            optimizer_type="" if optimizer is None else optimizer.type,
        )
        lora = body.lora_config
        if lora is not None:
            op.lora_config.CopyFrom(
                pb.LoraConfig(
                    rank=lora.rank,
                    seed=lora.seed,
                    train_unembed=lora.train_unembed,
                    train_mlp=lora.train_mlp,
                    train_attn=lora.train_attn,
                )
            )
        return pb.SubmitRequest(owner=owner, create_model=op)

    def answer(self, result: pb.JobResult, request_type: str | None) -> Response:
        return json_response(rs.CreateModelResult(model_id=result.create_model.model_id))
