"""Session traces: `RestClient.export_session_trace` and the signed URL it hands back.

The SDK polls `GET /api/v1/sessions/{id}/trace_export` until it says "ready" with a URL, then
downloads that URL with no auth header; like checkpoint downloads, the URL carries an HMAC
over (owner, session, expiry). The trace is Chrome-trace JSON (ui.perfetto.dev opens it).
"""

from __future__ import annotations

import hashlib
import hmac
import time
from urllib.parse import quote, urlencode

from fastapi import APIRouter, Request
from fastapi.responses import Response

from lockstep.gateway.deps import CALL_TIMEOUT_S, FileUrlSecret, Owner, Scheduler, Settings
from lockstep.gateway.errors import ApiError
from lockstep.gateway.validate import check_id
from lockstep.v1 import scheduler_pb2 as pb

router = APIRouter(tags=["sessions"])
TRACES_PREFIX = "/api/v1/session_traces"


def _sign(owner: str, session_id: str, expires: int, secret: bytes) -> str:
    message = "\0".join(("trace", owner, session_id, str(expires))).encode()
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


@router.get("/api/v1/sessions/{session_id}/trace_export")
async def trace_export(
    session_id: str,
    request: Request,
    owner: Owner,
    stub: Scheduler,
    settings: Settings,
    secret: FileUrlSecret,
) -> dict[str, str]:
    """Always "ready": the trace is assembled from Redis when the URL is fetched."""
    ref = pb.SessionRef(owner=owner, session_id=check_id("session_id", session_id))
    await stub.GetSession(ref, timeout=CALL_TIMEOUT_S)  # another key's session: 404
    expires = int(time.time()) + settings.file_url_ttl_seconds
    query = urlencode({"expires": expires, "sig": _sign(owner, session_id, expires, secret)})
    base = (settings.public_base_url or str(request.base_url)).rstrip("/")
    path = f"{TRACES_PREFIX}/{quote(owner, safe='')}/{quote(session_id, safe='')}"
    return {"status": "ready", "url": f"{base}{path}?{query}"}


@router.get(TRACES_PREFIX + "/{owner}/{session_id}")
async def trace_download(
    owner: str, session_id: str, expires: int, sig: str, stub: Scheduler, secret: FileUrlSecret
) -> Response:
    expected = _sign(owner, session_id, expires, secret)
    if not hmac.compare_digest(expected.encode(), sig.encode("utf-8", "replace")):
        raise ApiError(403, "invalid download signature")
    if time.time() > expires:
        raise ApiError(403, "download URL expired; call export_session_trace again")
    ref = pb.SessionRef(owner=owner, session_id=session_id)
    trace = await stub.GetSessionTrace(ref, timeout=CALL_TIMEOUT_S)
    return Response(
        trace.trace_json,
        media_type="application/json",
        headers={"Content-Disposition": f'attachment; filename="{session_id}.trace.json"'},
    )
