"""Sessions: create, heartbeat, finish, list, get."""

from __future__ import annotations

import json

from lockstep.gateway.schema import requests as rq
from lockstep.gateway.schema import responses as rs
from lockstep.gateway.translate.common import str_map
from lockstep.gateway.validate import check_id
from lockstep.v1 import scheduler_pb2 as pb


def create_session(owner: str, body: rq.CreateSessionRequest) -> pb.CreateSessionRequest:
    return pb.CreateSessionRequest(
        owner=owner,
        tags=body.tags,
        user_metadata=str_map(body.user_metadata),
        sdk_version=body.sdk_version,
        project_id=body.project_id,
        display_name=body.display_name,
    )


def session_info(info: pb.SessionInfo) -> rs.GetSessionResponse:
    return rs.GetSessionResponse(
        training_run_ids=list(info.training_run_ids),
        sampler_ids=list(info.sampler_ids),
        user_metadata=dict(info.user_metadata),
        display_name=info.display_name if info.HasField("display_name") else None,
    )


def create_custom_loss(owner: str, body: rq.CreateCustomLossRequest) -> pb.CreateCustomLossRequest:
    """The graph travels as JSON bytes: plain data the scheduler checks node by node."""
    return pb.CreateCustomLossRequest(
        owner=owner,
        session_id=check_id("session_id", body.session_id),
        custom_loss_seq_id=body.custom_loss_seq_id,
        name=body.name,
        inputs=[pb.CustomLossInput(name=x.name, rank=x.rank) for x in body.inputs],
        graph_json=json.dumps(body.graph.model_dump(mode="json")).encode(),
    )
