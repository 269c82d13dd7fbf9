"""Sessions: create_session, session_heartbeat, sessions/{id}/finish, GET sessions[/{id}],
create_custom_loss (a custom loss belongs to its session)."""

from __future__ import annotations

from fastapi import APIRouter

from lockstep.gateway.deps import CALL_TIMEOUT_S, Limit, Offset, Owner, Scheduler
from lockstep.gateway.errors import ApiError
from lockstep.gateway.schema import requests as rq
from lockstep.gateway.schema import responses as rs
from lockstep.gateway.translate import sessions as tr
from lockstep.gateway.validate import check_id
from lockstep.v1 import scheduler_pb2 as pb

router = APIRouter(prefix="/api/v1", tags=["sessions"])


@router.post("/create_session")
async def create_session(
    body: rq.CreateSessionRequest, owner: Owner, stub: Scheduler
) -> rs.CreateSessionResponse:
    reply = await stub.CreateSession(tr.create_session(owner, body), timeout=CALL_TIMEOUT_S)
    return rs.CreateSessionResponse(session_id=reply.session_id)


@router.post("/session_heartbeat")
async def session_heartbeat(
    body: rq.SessionHeartbeatRequest, owner: Owner, stub: Scheduler
) -> rs.SessionHeartbeatResponse:
    ref = pb.SessionRef(owner=owner, session_id=check_id("session_id", body.session_id))
    reply = await stub.Heartbeat(ref, timeout=CALL_TIMEOUT_S)
    if reply.finished:
        raise ApiError(410, f"session {body.session_id} is finished")  # stops the SDK's loop
    return rs.SessionHeartbeatResponse()


@router.post("/sessions/{session_id}/finish")
async def finish_session(
    session_id: str, owner: Owner, stub: Scheduler, body: rq.FinishSessionRequest | None = None
) -> dict[str, str]:
    ref = pb.SessionRef(owner=owner, session_id=check_id("session_id", session_id))
    await stub.FinishSession(ref, timeout=CALL_TIMEOUT_S)
    return {}


@router.post("/create_custom_loss")
async def create_custom_loss(
    body: rq.CreateCustomLossRequest, owner: Owner, stub: Scheduler
) -> rs.UntypedAPIFuture:
    """Stores a custom loss in the session; the future answers its loss id at once."""
    reply = await stub.CreateCustomLoss(tr.create_custom_loss(owner, body), timeout=CALL_TIMEOUT_S)
    return rs.UntypedAPIFuture(request_id=reply.request_id)


@router.get("/sessions")
async def list_sessions(
    owner: Owner, stub: Scheduler, limit: Limit = 20, offset: Offset = 0
) -> rs.ListSessionsResponse:
    reply = await stub.ListSessions(
        pb.ListRequest(owner=owner, limit=limit, offset=offset), timeout=CALL_TIMEOUT_S
    )
    return rs.ListSessionsResponse(sessions=list(reply.session_ids))


@router.get("/sessions/{session_id}")
async def get_session(session_id: str, owner: Owner, stub: Scheduler) -> rs.GetSessionResponse:
    ref = pb.SessionRef(owner=owner, session_id=check_id("session_id", session_id))
    return tr.session_info(await stub.GetSession(ref, timeout=CALL_TIMEOUT_S))
