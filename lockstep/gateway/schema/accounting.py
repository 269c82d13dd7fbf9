"""Wire shapes of the accounting routes (the SDK's AdminClient / RestClient types: audit log,
billing usage, checkpoint storage, session search, copy_weights)."""

from __future__ import annotations

from datetime import date, datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class SchemaModel(BaseModel):
    model_config = ConfigDict(protected_namespaces=(), extra="ignore")


# ---------------------------------------------------------------- requests
class StatusQuery(SchemaModel):
    type: Literal["active", "cancelled", "failed", "client_finished"]


class SearchOwner(SchemaModel):
    type: Literal["own", "accessible", "user"] = "own"


class SearchCursor(SchemaModel):
    last_created_at: datetime
    last_session_id: str


class SessionSearchRequest(SchemaModel):
    session_id: str | None = None
    project_ids: list[str] | None = None
    user_metadata: dict[str, str] = {}
    display_name: str | None = Field(default=None, min_length=1)
    owner: SearchOwner = SearchOwner()
    statuses: list[StatusQuery] | None = Field(default=None, min_length=1)
    limit: int = Field(default=50, ge=1, le=200)
    cursor: SearchCursor | None = None


class CopyWeightsRequest(SchemaModel):
    source_path: str
    session_id: str | None = None
    model_seq_id: int | None = Field(default=None, ge=0)
    destination_project_id: str | None = None
    ttl_seconds: int | None = None


# ---------------------------------------------------------------- responses
class AuditLogEntry(SchemaModel):
    timestamp: datetime
    event: str
    event_details: dict[str, Any] = {}
    model_id: str | None = None
    tinker_path: str | None = None


class AuditLogResponse(SchemaModel):
    entries: list[AuditLogEntry]


class UsageEventInfo(SchemaModel):
    """One of the SDK's BillingEventInfo variants; `steps`, `samples` and `cycle_seconds` are
    this server's extra counts (the SDK ignores unknown fields; `lockstep admin usage` shows
    them)."""

    type: Literal["training", "sampling_prefill", "sampling_sample", "checkpoint"]
    token_count: int | None = None
    count: int | None = None
    cached: bool | None = None
    steps: int | None = None
    samples: int | None = None
    cycle_seconds: float | None = None
    custom_losses: int | None = None  # training: custom losses the session stored


class BillingUsageEvent(SchemaModel):
    bucket_start: datetime
    bucket_end: datetime
    base_model: str | None = None
    session_id: str | None = None
    project_id: str | None = None
    estimated_cost_usd: float | None = None
    effective_rate_usd_per_million_tokens: float | None = None
    event_info: UsageEventInfo


class BillingUsageSession(SchemaModel):
    user_metadata: dict[str, str] | None = None


class BillingUsageResponse(SchemaModel):
    data: list[BillingUsageEvent]
    sessions: dict[str, BillingUsageSession] = {}


class StorageUsageItem(SchemaModel):
    project_id: str | None = None
    checkpoint_count: int
    size_bytes: int
    size_gigabytes: float
    estimated_monthly_cost_usd: float | None = None


class StorageUsageResponse(SchemaModel):
    effective_rate_usd_per_gigabyte_month: float | None = None
    data: list[StorageUsageItem]


class SessionSummary(SchemaModel):
    session_id: str
    created_at: datetime
    owner: str
    project_id: str
    status: dict[str, Any] | None = None
    checkpoints_count: int
    display_name: str | None = None
    user_metadata: dict[str, str] | None = None
    checkpoint_storage_bytes: int | None = None


class SessionSearchResponse(SchemaModel):
    sessions: list[SessionSummary]
    next_cursor: SearchCursor | None = None


class CopyWeightsResponse(SchemaModel):
    tinker_path: str


class DayUsage(SchemaModel):
    """One key's counters over one UTC day (the hourly buckets `lockstep admin usage` sums)."""

    day: date
    tokens_trained: int = 0
    tokens_prefill: int = 0
    tokens_sampled: int = 0
    steps: int = 0
    samples: int = 0
    cycle_seconds: float = 0.0
    checkpoints: int = 0
    custom_losses: int = 0


class KeyUsage(SchemaModel):
    owner: str  # sha256 of the key, 16 hex digits (lockstep.keyring.owner_of)
    name: str | None = None  # the keys file's name for it
    checkpoint_count: int
    storage_bytes: int
    days: list[DayUsage]  # every day of the window, oldest first


class DailyUsageResponse(SchemaModel):
    keys: list[KeyUsage]
