"""save_weights, save_weights_for_sampler, save_weights_external: the three routes of the
scheduler's one save op (a training checkpoint, sampler weights, or external weights)."""

from __future__ import annotations

from typing import Any, ClassVar

from fastapi import Response

from lockstep.gateway.errors import bad_request
from lockstep.gateway.ops.base import GatewayOp
from lockstep.gateway.schema import responses as rs
from lockstep.gateway.schema.requests import Int32, Int64, SchemaModel
from lockstep.gateway.translate.common import str_map
from lockstep.gateway.translate.futures import json_response
from lockstep.gateway.validate import check_id, check_seq_id
from lockstep.v1 import scheduler_pb2 as pb


class SaveWeightsRequest(SchemaModel):
    model_id: str
    path: str | None = None
    seq_id: int | None = None
    ttl_seconds: Int64 | None = None
    overwrite: bool = False
    user_metadata: dict[str, Any] | None = None


class SaveWeightsForSamplerRequest(SchemaModel):
    model_id: str
    path: str | None = None
    sampling_session_seq_id: Int32 | None = None
    kind: str = "snapshot"
    seq_id: int | None = None
    ttl_seconds: Int64 | None = None
    user_metadata: dict[str, Any] | None = None


class SaveWeightsExternalRequest(SchemaModel):
    model_id: str
    path: str
    seq_id: int | None = None
    ttl_seconds: Int64 | None = None
    age_encryption_recipients: list[str] | None = None


# `X-Tinker-Request-Type` header of retrieve_future -> the `type` literal of the save result.
_SAVE_TYPE_BY_HEADER = {
    "SaveWeights": "save_weights",
    "SaveWeightsForSampler": "save_weights_for_sampler",
    "SaveWeightsExternal": "save_weights_external",
}


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


class _Save(GatewayOp):
    """The three save routes build one kind of request and answer alike: the SaveResult, in
    the shape of the route that asked."""

    tag = "training"
    oneof = "save_weights"
    result = "save"
    sequenced = True

    @staticmethod
    def _request(owner: str, body: Any, kind: pb.CheckpointKind, **fields: Any) -> pb.SubmitRequest:
        op = pb.SaveWeights(
            model_id=check_id("model_id", body.model_id),
            seq_id=check_seq_id(body.seq_id),
            kind=kind,
            ttl_seconds=body.ttl_seconds,
            **fields,
        )
        return pb.SubmitRequest(owner=owner, save_weights=op)

    def answer(self, result: pb.JobResult, request_type: str | None) -> Response:
        save = result.save
        path = save.path if save.HasField("path") else None
        kind = _save_kind(save, request_type)
        if kind == "save_weights_for_sampler":
            session = save.sampling_session_id if save.HasField("sampling_session_id") else None
            return json_response(
                rs.SaveWeightsForSamplerResult(path=path, sampling_session_id=session)
            )
        if kind == "save_weights_external":
            return json_response(
                rs.SaveWeightsExternalResult(path=path or "", size_bytes=save.size_bytes or None)
            )
        return json_response(rs.SaveWeightsResult(path=path or ""))


class SaveWeights(_Save):
    name = "save_weights"
    path = "/api/v1/save_weights"
    body: ClassVar[type[SaveWeightsRequest]] = SaveWeightsRequest

    async def submit_request(self, owner: str, body: SaveWeightsRequest) -> pb.SubmitRequest:
        return self._request(
            owner,
            body,
            pb.CHECKPOINT_KIND_TRAINING,
            name=body.path,
            overwrite=body.overwrite,
            user_metadata=str_map(body.user_metadata),
        )


class SaveWeightsForSampler(_Save):
    """Named form (`path` = name) saves a sampler checkpoint; the unnamed form
    (`sampling_session_seq_id`) saves ephemeral weights and creates that sampling session."""

    name = "save_weights_for_sampler"
    path = "/api/v1/save_weights_for_sampler"
    body: ClassVar[type[SaveWeightsForSamplerRequest]] = SaveWeightsForSamplerRequest

    async def submit_request(
        self, owner: str, body: SaveWeightsForSamplerRequest
    ) -> pb.SubmitRequest:
        if body.kind not in ("snapshot", "inflight"):  # the contract's SamplerKind
            raise bad_request("kind", "must be 'snapshot' or 'inflight'")
        req = self._request(
            owner, body, pb.CHECKPOINT_KIND_SAMPLER, user_metadata=str_map(body.user_metadata)
        )
        op = req.save_weights
        if body.path is not None:
            op.name = body.path
        elif body.sampling_session_seq_id is not None:
            op.sampling_session_seq_id = body.sampling_session_seq_id
            if body.kind == "inflight":
                op.sampler_kind = pb.SAMPLER_KIND_INFLIGHT
        return req


class SaveWeightsExternal(_Save):
    name = "save_weights_external"
    path = "/api/v1/save_weights_external"
    body: ClassVar[type[SaveWeightsExternalRequest]] = SaveWeightsExternalRequest

    async def submit_request(
        self, owner: str, body: SaveWeightsExternalRequest
    ) -> pb.SubmitRequest:
        recipients = body.age_encryption_recipients or []
        return self._request(
            owner, body, pb.CHECKPOINT_KIND_EXTERNAL, name=body.path, age_recipients=recipients
        )
