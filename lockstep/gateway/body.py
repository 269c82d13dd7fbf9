"""Request-body handling shared by every route: size limit and Content-Encoding.

A pure ASGI middleware reads the whole body first (bounded by `max_body_bytes`), undoes
`Content-Encoding: zstd` (the SDK's `proto_compress_fwdbwd`) or gzip, and hands the routes a
plain body. Oversized bodies get 413, undecodable ones 400, both with a JSON `detail`.
"""

from __future__ import annotations

import io
import json
import zlib
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import zstandard

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class BodyError(Exception):
    def __init__(self, status_code: int, detail: str) -> None:
        super().__init__(detail)
        self.status_code = status_code
        self.detail = detail


def decompress(body: bytes, encoding: str, limit: int) -> bytes:
    """Undo a Content-Encoding; the decompressed size is bounded by `limit` (413 above it)."""
    encoding = encoding.strip().lower()
    if encoding in ("", "identity"):
        return body
    try:
        if encoding == "zstd":
            reader = zstandard.ZstdDecompressor().stream_reader(
                io.BytesIO(body), read_across_frames=True
            )
            out = reader.read(limit + 1)
        elif encoding in ("gzip", "x-gzip", "deflate"):
            wbits = zlib.MAX_WBITS | 32 if encoding != "deflate" else zlib.MAX_WBITS
            dec = zlib.decompressobj(wbits)
            out = dec.decompress(body, limit + 1)
        else:
            raise BodyError(415, f"Content-Encoding: {encoding!r} is not supported (use zstd)")
    except (zstandard.ZstdError, zlib.error) as e:
        raise BodyError(400, f"body: not valid {encoding} data ({e})") from e
    if len(out) > limit:
        raise BodyError(413, f"body: larger than {limit} bytes once decompressed")
    return out


class BodyLimitMiddleware:
    """Buffers, bounds and decompresses HTTP request bodies before the app sees them."""

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers: list[tuple[bytes, bytes]] = list(scope.get("headers", []))
        try:
            body, encoding = await self._read(headers, receive)
            if encoding and body:
                body = decompress(body, encoding, self.max_body_bytes)
        except BodyError as e:
            await _send_json(send, e.status_code, {"detail": e.detail})
            return
        if encoding:
            headers = [
                (k, v) for k, v in headers if k not in (b"content-encoding", b"content-length")
            ]
            headers.append((b"content-length", str(len(body)).encode()))
            scope["headers"] = headers  # in place: outer middleware reads the scope afterwards

        sent = False

        async def replay() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # http.disconnect, when the client goes away

        await self.app(scope, replay, send)

    async def _read(
        self, headers: list[tuple[bytes, bytes]], receive: Receive
    ) -> tuple[bytes, str]:
        encoding = ""
        for key, value in headers:
            if key == b"content-length":
                try:
                    declared = int(value)
                except ValueError as e:
                    raise BodyError(400, "Content-Length: not an integer") from e
                if declared > self.max_body_bytes:
                    raise BodyError(413, f"body: larger than {self.max_body_bytes} bytes")
            elif key == b"content-encoding":
                encoding = value.decode("latin-1")
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise BodyError(413, f"body: larger than {self.max_body_bytes} bytes")
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        return b"".join(chunks), encoding


async def _send_json(send: Send, status: int, payload: dict[str, Any]) -> None:
    data = json.dumps(payload).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(data)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": data})
