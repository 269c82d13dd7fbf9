"""Sampling sessions: create_sampling_session, join_sampling_session, GET samplers/{id}. The
submission (asample) is an op, `gateway/ops/sample.py`."""

from __future__ import annotations

from fastapi import APIRouter

from lockstep.gateway.deps import CALL_TIMEOUT_S, Owner, Scheduler
from lockstep.gateway.schema import requests as rq
from lockstep.gateway.schema import responses as rs
from lockstep.gateway.translate import sampling as tr
from lockstep.gateway.validate import check_id
from lockstep.v1 import scheduler_pb2 as pb

router = APIRouter(prefix="/api/v1", tags=["sampling"])


@router.post("/create_sampling_session")
async def create_sampling_session(
    body: rq.CreateSamplingSessionRequest, owner: Owner, stub: Scheduler
) -> rs.CreateSamplingSessionResponse:
    info = await stub.CreateSamplingSession(
        tr.create_sampling_session(owner, body), timeout=CALL_TIMEOUT_S
    )
    return rs.CreateSamplingSessionResponse(sampling_session_id=info.sampler_id)


@router.post("/join_sampling_session")
async def join_sampling_session(
    body: rq.JoinSamplingSessionRequest, owner: Owner, stub: Scheduler
) -> rs.JoinSamplingSessionResponse:
    """An unpickled SamplingClient's clone id, unique in its sampling session."""
    ref = pb.SamplerRef(
        owner=owner, sampler_id=check_id("sampling_session_id", body.sampling_session_id)
    )
    reply = await stub.JoinSamplingSession(ref, timeout=CALL_TIMEOUT_S)
    return rs.JoinSamplingSessionResponse(client_counter=reply.client_counter)


@router.get("/samplers/{sampler_id}")
async def get_sampler(sampler_id: str, owner: Owner, stub: Scheduler) -> rs.GetSamplerResponse:
    ref = pb.SamplerRef(owner=owner, sampler_id=check_id("sampler_id", sampler_id))
    return tr.sampler_info(await stub.GetSampler(ref, timeout=CALL_TIMEOUT_S))
