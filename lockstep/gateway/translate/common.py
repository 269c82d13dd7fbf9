"""Small conversions shared by the translation modules."""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any


def str_map(values: Mapping[str, Any] | None) -> dict[str, str]:
    """SDK metadata (`dict[str, Any]`) as the contract's `map<string, string>`.

    Strings pass through; anything else is kept as its JSON text.
    """
    if not values:
        return {}
    return {str(k): v if isinstance(v, str) else json.dumps(v) for k, v in values.items()}


def utc(unix_seconds: float) -> datetime:
    """A timezone-aware UTC datetime from unix seconds (serializes with a 'Z' suffix)."""
    return datetime.fromtimestamp(unix_seconds, tz=UTC)


def optional_str(value: str) -> str | None:
    """proto3 strings are '' when unset; the SDK wants null."""
    return value or None
