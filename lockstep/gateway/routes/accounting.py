"""Accounting, scoped to the caller's key: checkpoint storage, usage by hour, the audit log,
session search and copy_weights (the SDK's RestClient / AdminClient routes)."""

from __future__ import annotations

import json
from datetime import UTC, date, datetime, timedelta
from typing import Annotated

from fastapi import APIRouter, Query, Request

from lockstep.gateway.deps import CALL_TIMEOUT_S, Owner, Reader, Scheduler
from lockstep.gateway.errors import bad_request
from lockstep.gateway.schema import accounting as wa
from lockstep.gateway.translate.common import utc
from lockstep.gateway.validate import check_id, parse_tinker_path
from lockstep.v1 import scheduler_pb2 as pb

router = APIRouter(prefix="/api/v1", tags=["accounting"])

GB = 1e9
MAX_USAGE_WINDOW = timedelta(days=14)  # the SDK's documented limit
MAX_DAILY_DAYS = 90  # the usage counters' default retention (--audit-retention)
# The counters of a bucket, as DayUsage names them (the UsageBucket fields).
DAY_COUNTERS = tuple(f for f in wa.DayUsage.model_fields if f != "day")
HOUR = timedelta(hours=1)
# The SDK's event_type filter: "projects", "teams" and "organizations" are hosted-console
# resources (nothing here records them, so they are always empty).
AUDIT_EVENT_TYPES = ("all", "checkpoints", "projects", "teams", "organizations")


@router.get("/billing/usage/checkpoints/current")
async def checkpoint_storage(
    owner: Owner, stub: Scheduler, project_id: str | None = None
) -> wa.StorageUsageResponse:
    reply = await stub.StorageUsage(pb.OwnerRef(owner=owner), timeout=CALL_TIMEOUT_S)
    item = wa.StorageUsageItem(
        project_id=project_id,
        checkpoint_count=reply.checkpoint_count,
        size_bytes=reply.size_bytes,
        size_gigabytes=reply.size_bytes / GB,
    )
    return wa.StorageUsageResponse(data=[item])


def _aware(value: datetime) -> datetime:
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


@router.get("/billing/usage/events")
async def usage_events(
    owner: Owner, stub: Scheduler, starting_on: datetime, ending_before: datetime
) -> wa.BillingUsageResponse:
    start = _aware(starting_on)
    end = _aware(ending_before)
    if end <= start:
        raise bad_request("ending_before", "must be after starting_on")
    if end - start > MAX_USAGE_WINDOW:
        raise bad_request("ending_before", "at most 14 days after starting_on")
    reply = await stub.Usage(
        pb.UsageRequest(owner=owner, start=start.timestamp(), end=end.timestamp()),
        timeout=CALL_TIMEOUT_S,
    )
    data: list[wa.BillingUsageEvent] = []
    for b in reply.buckets:
        infos = [
            wa.UsageEventInfo(
                type="training",
                token_count=b.tokens_trained,
                steps=b.steps,
                cycle_seconds=b.cycle_seconds,
                custom_losses=b.custom_losses or None,
            ),
            wa.UsageEventInfo(type="sampling_prefill", token_count=b.tokens_prefill, cached=False),
            wa.UsageEventInfo(
                type="sampling_sample", token_count=b.tokens_sampled, samples=b.samples
            ),
            wa.UsageEventInfo(type="checkpoint", count=b.checkpoints),
        ]
        for info in infos:
            if any(
                (
                    info.token_count,
                    info.count,
                    info.steps,
                    info.cycle_seconds,
                    info.samples,
                    info.custom_losses,
                )
            ):
                data.append(
                    wa.BillingUsageEvent(
                        bucket_start=utc(b.start),
                        bucket_end=utc(b.start) + HOUR,
                        base_model=b.base_model or None,
                        session_id=b.session_id or None,
                        event_info=info,
                    )
                )
    sessions = {e.session_id: wa.BillingUsageSession() for e in data if e.session_id}
    return wa.BillingUsageResponse(data=data, sessions=sessions)


@router.get("/usage/daily")
async def daily_usage(
    request: Request,
    scope: Reader,
    stub: Scheduler,
    days: Annotated[int, Query(ge=1, le=MAX_DAILY_DAYS)] = 7,
) -> wa.DailyUsageResponse:
    """Usage per key by UTC day over the last `days` days (today included), with each key's
    checkpoint storage: the caller's own, or every key's for an admin key asking with
    `access_scope=accessible` (what `lockstep admin usage` sums, by day)."""
    today = datetime.now(UTC).date()
    first = today - timedelta(days=days - 1)
    start = datetime.combine(first, datetime.min.time(), tzinfo=UTC)
    reply = await stub.Usage(
        pb.UsageRequest(
            owner=scope.owner,
            start=start.timestamp(),
            end=(start + timedelta(days=days)).timestamp(),
            all_owners=scope.all_owners,
        ),
        timeout=CALL_TIMEOUT_S,
    )
    window = [first + timedelta(days=i) for i in range(days)]
    per_key: dict[str, dict[date, wa.DayUsage]] = {scope.owner: {}}
    for b in reply.buckets:
        owner = b.owner or scope.owner
        day = utc(b.start).date()
        usage = per_key.setdefault(owner, {}).setdefault(day, wa.DayUsage(day=day))
        for name in DAY_COUNTERS:
            setattr(usage, name, getattr(usage, name) + getattr(b, name))
    keyring = request.app.state.keyring
    names = keyring.names() if keyring is not None else {}
    keys = []
    for owner in sorted(per_key, key=lambda o: (o != scope.owner, names.get(o, ""), o)):
        storage = await stub.StorageUsage(pb.OwnerRef(owner=owner), timeout=CALL_TIMEOUT_S)
        keys.append(
            wa.KeyUsage(
                owner=owner,
                name=names.get(owner),
                checkpoint_count=storage.checkpoint_count,
                storage_bytes=storage.size_bytes,
                days=[per_key[owner].get(d, wa.DayUsage(day=d)) for d in window],
            )
        )
    return wa.DailyUsageResponse(keys=keys)


@router.get("/audit")
async def audit_log(
    owner: Owner,
    stub: Scheduler,
    event_type: Annotated[str, Query()] = "all",
    day: date | None = None,
) -> wa.AuditLogResponse:
    if event_type not in AUDIT_EVENT_TYPES:
        raise bad_request("event_type", f"one of {', '.join(AUDIT_EVENT_TYPES)}")
    first = datetime.combine(day or datetime.now(UTC).date(), datetime.min.time(), tzinfo=UTC)
    reply = await stub.AuditLog(
        pb.AuditLogRequest(
            owner=owner, start=first.timestamp(), end=(first + timedelta(days=1)).timestamp()
        ),
        timeout=CALL_TIMEOUT_S,
    )
    entries = []
    for e in reply.entries:
        if event_type != "all" and not (
            event_type == "checkpoints" and e.event.startswith("checkpoint_")
        ):
            continue
        details = json.loads(e.details_json or "{}")
        entries.append(
            wa.AuditLogEntry(
                timestamp=utc(e.time),
                event=e.event,
                event_details=details,
                model_id=details.get("model_id"),
                tinker_path=details.get("tinker_path"),
            )
        )
    return wa.AuditLogResponse(entries=entries)


@router.post("/sessions/search")
async def search_sessions(
    body: wa.SessionSearchRequest, owner: Owner, stub: Scheduler
) -> wa.SessionSearchResponse:
    # A key sees its own sessions whatever `owner` asks for ("accessible" = own here).
    request = pb.SearchSessionsRequest(
        owner=owner, user_metadata=body.user_metadata, limit=body.limit
    )
    if body.session_id is not None:
        request.session_id = check_id("session_id", body.session_id)
    if body.display_name is not None:
        request.display_name = body.display_name
    for status in body.statuses or []:
        request.statuses.append(status.type)
    if body.cursor is not None:
        request.before_created = _aware(body.cursor.last_created_at).timestamp()
        request.before_session_id = body.cursor.last_session_id
    reply = await stub.SearchSessions(request, timeout=CALL_TIMEOUT_S)
    sessions = [
        wa.SessionSummary(
            session_id=s.session_id,
            created_at=utc(s.created),
            owner="you",
            project_id=s.project_id if s.HasField("project_id") else "",
            status=(
                {"type": "client_finished", "reason": {"type": "success"}}
                if s.status == "client_finished"
                else {"type": "active"}
            ),
            checkpoints_count=s.checkpoints_count,
            display_name=s.display_name if s.HasField("display_name") else None,
            user_metadata=dict(s.user_metadata) or None,
            checkpoint_storage_bytes=s.checkpoint_storage_bytes,
        )
        for s in reply.sessions
    ]
    cursor = None
    if reply.more and sessions:
        last = sessions[-1]
        cursor = wa.SearchCursor(last_created_at=last.created_at, last_session_id=last.session_id)
    return wa.SessionSearchResponse(sessions=sessions, next_cursor=cursor)


@router.post("/copy_weights")
async def copy_weights(
    body: wa.CopyWeightsRequest, owner: Owner, stub: Scheduler
) -> wa.CopyWeightsResponse:
    request = pb.CopyWeightsRequest(
        owner=owner, source_path=str(parse_tinker_path("source_path", body.source_path))
    )
    if body.session_id is not None:
        request.session_id = check_id("session_id", body.session_id)
    if body.model_seq_id is not None:
        request.model_seq_id = body.model_seq_id
    if body.ttl_seconds is not None:
        request.ttl_seconds = body.ttl_seconds
    reply = await stub.CopyWeights(request, timeout=CALL_TIMEOUT_S)
    return wa.CopyWeightsResponse(tinker_path=reply.tinker_path)
