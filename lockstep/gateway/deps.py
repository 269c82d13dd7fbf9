"""Shared route dependencies: settings, the scheduler stub, and API-key authentication."""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import Annotated, Literal

from fastapi import Depends, Header, Query, Request
from starlette.requests import HTTPConnection

from lockstep.gateway.answers import Answers
from lockstep.gateway.errors import ApiError
from lockstep.gateway.settings import GatewaySettings
from lockstep.gateway.stub import TimedStub
from lockstep.keyring import KeyRing, owner_of

__all__ = ["owner_of"]  # the owner id rule lives in lockstep.keyring

# Deadline of an ordinary (non-long-poll) scheduler call. The SDK's own read timeout is 60 s.
CALL_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Caller:
    owner: str  # the id the scheduler scopes everything to (lockstep.keyring.owner_of)
    max_training_runs: int = 0  # the keys file's quota for this key; 0: none
    admin: bool = False  # also reads every key's runs and usage (access_scope=accessible)


@dataclass(frozen=True)
class Scope:
    """What a read covers: the caller's own, or every owner's (`all_owners`: an admin key that
    asked with `access_scope=accessible`, as the SDK's RestClient can). Writes take `Owner`."""

    owner: str
    all_owners: bool = False


def authenticate(conn: HTTPConnection, api_key: str | None) -> Caller:
    """The one key check of every route: the keys file (re-read on SIGHUP), then the settings'
    key list or any `tml-` key. The caller, else a 401 (which the SDK does not retry)."""
    settings: GatewaySettings = conn.app.state.settings
    keyring: KeyRing | None = conn.app.state.keyring
    if not api_key:
        raise ApiError(401, "missing API key: send it in the X-API-Key header")
    admin = False  # compared with every admin key, as below
    for known in settings.admin_keys:
        admin |= hmac.compare_digest(known.encode(), api_key.encode())
    if admin:
        return Caller(owner_of(api_key), admin=True)
    entry = keyring.lookup(api_key) if keyring is not None else None
    if entry is not None:
        if entry.revoked:
            raise ApiError(401, f"API key {entry.name!r} is revoked")
        return Caller(owner_of(api_key), entry.max_training_runs, entry.admin)
    if keyring is not None and not settings.api_keys:
        raise ApiError(401, "invalid API key")
    if settings.api_keys:
        # Compare against every key so the time taken does not depend on which one matched.
        matched = False
        for known in settings.api_keys:
            matched |= hmac.compare_digest(known.encode(), api_key.encode())
        if not matched:
            raise ApiError(401, "invalid API key")
    elif not settings.allow_any_tml_key:
        raise ApiError(401, "invalid API key (this server has no API keys configured)")
    elif not api_key.startswith("tml-"):
        raise ApiError(401, "invalid API key: it must start with 'tml-'")
    return Caller(owner_of(api_key))


def api_key_of(conn: HTTPConnection) -> str | None:
    """The Tinker routes' key: the `X-API-Key` header (for code that is not a dependency)."""
    return conn.headers.get("x-api-key")


# Dependencies are `async def` though they never await: FastAPI runs a plain `def` dependency
# in its thread pool, two thread hops per request for reading an attribute.


def settings_of(request: Request) -> GatewaySettings:
    settings: GatewaySettings = request.app.state.settings
    return settings


async def get_settings(request: Request) -> GatewaySettings:
    return settings_of(request)


async def get_scheduler(request: Request) -> TimedStub:
    """The `SchedulerStub` bound to the app's grpc.aio channel (opened in the lifespan)."""
    stub: TimedStub = request.app.state.scheduler
    return stub


async def get_answers(request: Request) -> Answers:
    """Sample answers the session polls brought along (`gateway/answers.py`)."""
    answers: Answers = request.app.state.answers
    return answers


async def require_caller(
    request: Request, x_api_key: Annotated[str | None, Header(alias="X-API-Key")] = None
) -> Caller:
    return authenticate(request, x_api_key)


async def require_owner(caller: Annotated[Caller, Depends(require_caller)]) -> str:
    return caller.owner


async def key_quota(caller: Annotated[Caller, Depends(require_caller)]) -> int:
    """The caller's training-run quota from the keys file (0: none)."""
    return caller.max_training_runs


async def read_scope(
    caller: Annotated[Caller, Depends(require_caller)],
    access_scope: Annotated[Literal["owned", "accessible"], Query()] = "owned",
) -> Scope:
    """The one rule of who reads what: an admin key asking for `accessible` reads every
    owner's; anyone else reads their own (`accessible` included: nothing is shared here but
    published checkpoints, which every key reads by path)."""
    return Scope(caller.owner, caller.admin and access_scope == "accessible")


Owner = Annotated[str, Depends(require_owner)]
Reader = Annotated[Scope, Depends(read_scope)]
KeyQuota = Annotated[int, Depends(key_quota)]
Scheduler = Annotated[TimedStub, Depends(get_scheduler)]
Settings = Annotated[GatewaySettings, Depends(get_settings)]
Prefetched = Annotated[Answers, Depends(get_answers)]

# Paging query parameters of the list endpoints.
Limit = Annotated[int, Query(ge=1, le=100_000)]
Offset = Annotated[int, Query(ge=0, le=2**31 - 1)]


async def get_file_url_secret(request: Request) -> bytes:
    """The key signing checkpoint download URLs (settings', or a random one per process)."""
    secret: bytes = request.app.state.file_url_secret
    return secret


FileUrlSecret = Annotated[bytes, Depends(get_file_url_secret)]


async def require_bearer_owner(
    request: Request,
    authorization: Annotated[str | None, Header()] = None,
    x_api_key: Annotated[str | None, Header(alias="X-API-Key")] = None,
) -> str:
    """The OpenAI- and Anthropic-compatible routes: the same keys, sent as `Authorization:
    Bearer <key>` (OpenAI clients) or `x-api-key` (Anthropic clients, and the Tinker header)."""
    key = x_api_key
    if authorization:
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            key = token.strip()
    return authenticate(request, key).owner


BearerOwner = Annotated[str, Depends(require_bearer_owner)]
