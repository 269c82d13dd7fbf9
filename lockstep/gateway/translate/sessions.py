"""Sessions: create, heartbeat, finish, list, get."""

from __future__ import annotations

from lockstep.gateway.translate.common import str_map
from lockstep.gateway.wire import requests as rq
from lockstep.gateway.wire import responses as rs
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
