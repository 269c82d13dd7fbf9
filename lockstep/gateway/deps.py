"""Shared route dependencies: settings, the scheduler stub, and API-key authentication."""

from __future__ import annotations

import hashlib
import hmac
from typing import Annotated, Any

from fastapi import Depends, Header, Query, Request

from lockstep.gateway.errors import ApiError
from lockstep.gateway.settings import GatewaySettings

# Deadline of an ordinary (non-long-poll) scheduler call. The SDK's own read timeout is 60 s.
CALL_TIMEOUT_S = 30.0


def owner_of(api_key: str) -> str:
    """The stable owner id the scheduler scopes everything to: sha256(key) hex, 16 chars."""
    return hashlib.sha256(api_key.encode()).hexdigest()[:16]


def authenticate(settings: GatewaySettings, api_key: str | None) -> str:
    """Check an `X-API-Key` against the settings; the caller's owner id, else a 401."""
    if not api_key:
        raise ApiError(401, "missing API key: send it in the X-API-Key header")
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
    return owner_of(api_key)


def get_settings(request: Request) -> GatewaySettings:
    settings: GatewaySettings = request.app.state.settings
    return settings


def get_scheduler(request: Request) -> Any:
    """The `SchedulerStub` bound to the app's grpc.aio channel (opened in the lifespan)."""
    return request.app.state.scheduler


async def require_owner(
    request: Request, x_api_key: Annotated[str | None, Header(alias="X-API-Key")] = None
) -> str:
    return authenticate(get_settings(request), x_api_key)


Owner = Annotated[str, Depends(require_owner)]
Scheduler = Annotated[Any, Depends(get_scheduler)]
Settings = Annotated[GatewaySettings, Depends(get_settings)]

# Paging query parameters of the list endpoints.
Limit = Annotated[int, Query(ge=1, le=100_000)]
Offset = Annotated[int, Query(ge=0, le=2**31 - 1)]


def get_file_url_secret(request: Request) -> bytes:
    """The key signing checkpoint download URLs (settings', or a random one per process)."""
    secret: bytes = request.app.state.file_url_secret
    return secret


FileUrlSecret = Annotated[bytes, Depends(get_file_url_secret)]
