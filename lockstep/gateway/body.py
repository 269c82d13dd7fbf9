"""Request-body handling shared by every route: size limit and Content-Encoding.

A pure ASGI middleware reads the whole body first (bounded by `max_body_bytes`), undoes
`Content-Encoding: zstd` (the SDK's `proto_compress_fwdbwd`) or gzip, and hands the routes a
plain body. Oversized bodies get 413, undecodable ones 400, both with a JSON `detail`.

The body it read (of a refused one, its first bytes) stays in the scope for the refusal report
(`request_body`, lockstep.gateway.refusals): a refused training request names its seq_id there.
"""

from __future__ import annotations

import email.message
import functools
import io
import json
import zlib

import zstandard
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from lockstep.observability import gateway_metrics

__all__ = ["ASGIApp", "Message", "Receive", "Scope", "Send"]  # Starlette's ASGI types


# How much of a refused body is kept: a request's ids come first (protobuf field order), and
# a refusal report must stay cheap.
PREFIX_BYTES = 64 * 1024
_BODY = "lockstep.body"


@functools.lru_cache(maxsize=64)
def is_json(content_type: str | None) -> bool:
    """Whether a body is JSON by its Content-Type: `application/json` or `application/*+json`,
    the test FastAPI reads a body model by. The one test of every route (the direct layer's
    plain path, a forward_backward's JSON form, the refusal report); a body without a
    Content-Type is not JSON here (a forward_backward's is protobuf, and the direct layer
    leaves it to FastAPI)."""
    if not content_type:
        return False
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (
        subtype == "json" or subtype.endswith("+json")
    )


def request_body(scope: Scope) -> bytes:
    """The decompressed body of this request as the app saw it, or the first bytes of a body
    this middleware refused (empty if it could not read one)."""
    body: bytes = scope.get(_BODY, b"")
    return body


class BodyError(Exception):
    def __init__(self, status_code: int, detail: str, prefix: bytes = b"") -> None:
        super().__init__(detail)
        self.status_code = status_code
        self.detail = detail
        self.prefix = prefix[:PREFIX_BYTES]  # what could be read of the refused body


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
        raise BodyError(413, f"body: larger than {limit} bytes once decompressed", out)
    gateway_metrics.compressed_body(encoding, len(body), len(out))
    return out


def replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that hands the app `body` (already read) whole, then the client's own
    messages (its disconnect)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # http.disconnect, when the client goes away

    return replayed


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
            scope[_BODY] = e.prefix  # in place, like the headers below
            await _send_json(send, e.status_code, {"detail": e.detail})
            return
        scope[_BODY] = body
        if encoding:
            headers = [
                (k, v) for k, v in headers if k not in (b"content-encoding", b"content-length")
            ]
            headers.append((b"content-length", str(len(body)).encode()))
            scope["headers"] = headers  # in place: outer middleware reads the scope afterwards

        await self.app(scope, replay(body, receive), send)

    async def _read(
        self, headers: list[tuple[bytes, bytes]], receive: Receive
    ) -> tuple[bytes, str]:
        encoding = ""
        declared = 0
        for key, value in headers:
            if key == b"content-length":
                try:
                    declared = int(value)
                except ValueError as e:
                    raise BodyError(400, "Content-Length: not an integer") from e
            elif key == b"content-encoding":
                encoding = value.decode("latin-1")
        # Past the limit only the first bytes are read, for the refusal report.
        stop = min(PREFIX_BYTES, self.max_body_bytes) if declared > self.max_body_bytes else None
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            chunks.append(chunk)
            if size > self.max_body_bytes or (stop is not None and size >= stop):
                break
            if not message.get("more_body", False):
                break
        if size > self.max_body_bytes or stop is not None:
            # compressed bytes name nothing; a plain body names its ids in its first bytes
            prefix = b"" if encoding else _head(chunks, PREFIX_BYTES)
            raise BodyError(413, f"body: larger than {self.max_body_bytes} bytes", prefix)
        return b"".join(chunks), encoding


def _head(chunks: list[bytes], size: int) -> bytes:
    """The first `size` bytes of the chunks, without joining all of them."""
    out = bytearray()
    for chunk in chunks:
        out += chunk[: size - len(out)]
        if len(out) >= size:
            break
    return bytes(out)


async def _send_json(send: Send, status: int, payload: dict[str, str]) -> None:
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
