"""Sampling sessions: create_sampling_session, GET samplers/{id}."""

from __future__ import annotations

from lockstep.gateway.schema import requests as rq
from lockstep.gateway.schema import responses as rs
from lockstep.gateway.validate import check_id
from lockstep.v1 import scheduler_pb2 as pb


def create_sampling_session(
    owner: str, body: rq.CreateSamplingSessionRequest
) -> pb.CreateSamplingSessionRequest:
    """The address (the session) is the gateway's to check; what the sampler samples from is
    the scheduler's (`Catalog.create_sampler`)."""
    return pb.CreateSamplingSessionRequest(
        owner=owner,
        session_id=check_id("session_id", body.session_id),
        sampling_session_seq_id=body.sampling_session_seq_id,
        model_path=body.model_path,
        base_model=body.base_model or None,
    )


def sampler_info(info: pb.SamplerInfo) -> rs.GetSamplerResponse:
    return rs.GetSamplerResponse(
        sampler_id=info.sampler_id,
        base_model=info.base_model,
        model_path=info.model_path if info.HasField("model_path") else None,
    )
