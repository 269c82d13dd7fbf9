"""Server-sent events and the small pieces every compatible route shares.

The engines return whole sequences (a sample is one batched engine call), so a streamed answer is
sent once its sample is complete, one event per token; it reassembles to the non-streamed text.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterable, Iterator
from typing import Any

from fastapi.responses import StreamingResponse

from lockstep.gateway.errors import bad_request


def event(data: dict[str, Any], name: str | None = None) -> str:
    head = f"event: {name}\n" if name else ""
    return f"{head}data: {json.dumps(data, separators=(',', ':'))}\n\n"


def stream(events: Iterable[str]) -> StreamingResponse:
    def body() -> Iterator[str]:
        yield from events

    return StreamingResponse(
        body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )


def new_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(12)}"


def refuse(fields: list[str]) -> None:
    """A 400 naming the first field whose value this server cannot honour."""
    if fields:
        raise bad_request(fields[0], "is not supported by this server")
