"""A training request the gateway refuses still uses its seq_id: the gateway tells the scheduler.

The SDK numbers a model's requests 1, 2, 3, ... and moves on to the next number as soon as a
submission is answered, even with a 4xx. The scheduler runs a model's requests strictly in
order, so a refused number must be recorded or every later request of that model waits for it.

Whatever refused a request on a sequenced route (an op that says `sequenced`, `gateway/ops/`)
— the body's size or encoding, its decoding, the request model, a gateway rule —
`RefusalMiddleware` sees the 4xx on its way out and sends the
scheduler one typed `Refused` with the ids it can read from the raw body, before the client
hears the answer. Whether that holds the seq_id (is the caller the model's owner, is the seq_id
still free) is the scheduler's call alone (`Submissions`). What the scheduler refused itself it
has already held, so those answers pass through.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import grpc
from starlette.requests import Request

from lockstep.gateway.body import ASGIApp, Message, Receive, Scope, Send, is_json, request_body
from lockstep.gateway.deps import CALL_TIMEOUT_S, api_key_of, authenticate
from lockstep.gateway.errors import ApiError, answered_by_scheduler
from lockstep.gateway.ops import registry
from lockstep.v1 import scheduler_pb2 as pb

log = logging.getLogger("lockstep.gateway")


_INT32_MAX = 2**31 - 1


def read_ids(body: bytes, content_type: str | None) -> tuple[str, int] | None:
    """(model_id, seq_id) of a body that may be truncated, malformed or refused; None if it
    does not name both. Only the top level counts: a nested `seq_id` names nothing."""
    if is_json(content_type) or body.lstrip()[:1] == b"{":
        fields = _json_top_level(body.decode("utf-8", "replace"))
        model_id, seq_id = fields.get("model_id"), fields.get("seq_id")
    else:
        model_id, seq_id = _proto_ids(body)
    if not isinstance(model_id, str) or not model_id:
        return None
    if isinstance(seq_id, bool) or not isinstance(seq_id, int) or not 1 <= seq_id <= _INT32_MAX:
        return None
    return model_id, seq_id


_DECODER = json.JSONDecoder()


def _skip_space(text: str, pos: int) -> int:
    while text[pos : pos + 1] in (" ", "\t", "\n", "\r"):
        pos += 1
    return pos


def _json_top_level(text: str) -> dict[str, Any]:
    """The top-level members of a JSON object, read until the text stops making sense."""
    found: dict[str, Any] = {}
    pos = _skip_space(text, 0)
    if text[pos : pos + 1] != "{":
        return found
    pos += 1
    while True:
        try:
            pos = _skip_space(text, pos)
            key, pos = _DECODER.raw_decode(text, pos)
            pos = _skip_space(text, pos)
            if not isinstance(key, str) or text[pos : pos + 1] != ":":
                return found
            pos = _skip_space(text, pos + 1)
            found[key], pos = _DECODER.raw_decode(text, pos)
        except ValueError:  # cut off or malformed here: what came before stands
            return found
        pos = _skip_space(text, pos)
        if text[pos : pos + 1] != ",":
            return found
        pos += 1


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise ValueError("truncated varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, pos


def _proto_ids(data: bytes) -> tuple[str | None, int | None]:
    """Fields 1 (model_id) and 2 (seq_id) of a ForwardBackwardRequest, read field by field so a
    message cut or broken after them still names them (they are serialized first)."""
    model_id: str | None = None
    seq_id: int | None = None
    pos = 0
    try:
        while pos < len(data) and (model_id is None or seq_id is None):
            tag, pos = _varint(data, pos)
            field, wire_type = tag >> 3, tag & 7
            if wire_type == 0:
                value, pos = _varint(data, pos)
                if field == 2:  # int32: a negative value is sign-extended to 64 bits
                    seq_id = value - (1 << 64) if value >> 63 else value
            elif wire_type == 2:
                size, pos = _varint(data, pos)
                if pos + size > len(data):
                    break
                if field == 1:
                    model_id = data[pos : pos + size].decode()
                pos += size
            elif wire_type in (1, 5):
                pos += 8 if wire_type == 1 else 4
            else:
                break
    except (ValueError, UnicodeDecodeError):
        pass
    return model_id, seq_id


async def report(request: Request, body: bytes, reason: str) -> None:
    """Tell the scheduler that this request was refused; it holds the seq_id if it may."""
    try:
        caller = authenticate(request, api_key_of(request))
    except ApiError:
        return  # not the owner's request, so not the owner's seq_id
    ids = read_ids(body, request.headers.get("content-type"))
    if ids is None:
        return  # names no model and seq_id: there is nothing to hold
    refused = pb.Refused(model_id=ids[0], seq_id=ids[1], reason=reason)
    try:
        await request.app.state.scheduler.Submit(
            pb.SubmitRequest(owner=caller.owner, refused=refused), timeout=CALL_TIMEOUT_S
        )
    except grpc.aio.AioRpcError as exc:  # the 4xx still goes out; log why the hold did not
        log.warning("could not report refused seq %s of %s: %s", ids[1], ids[0], exc.details())


def _detail(chunks: list[bytes]) -> str:
    try:
        detail = json.loads(b"".join(chunks))["detail"]
    except (ValueError, KeyError, TypeError):
        return "refused"
    return detail if isinstance(detail, str) else json.dumps(detail)


class RefusalMiddleware:
    """On a sequenced route, a 4xx the gateway answered is reported (`report`) before it is sent.

    It sits outside BodyLimitMiddleware, so it also sees that one's 413s and 400s; the body it
    reports is what that middleware kept (`request_body`). 429 is not a refusal: the SDK sends
    the same seq_id again.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope.get("method") != "POST"
            or scope.get("path") not in registry.sequenced_paths()
        ):
            await self.app(scope, receive, send)
            return
        held: list[Message] = []

        async def send_after_report(message: Message) -> None:
            if message["type"] == "http.response.start":
                status = int(message["status"])
                refused = 400 <= status < 500 and status != 429
                if refused and not answered_by_scheduler(scope):
                    held.append(message)
                    return
            elif held:
                held.append(message)
                if message.get("more_body", False):
                    return
                chunks = [m.get("body", b"") for m in held[1:]]
                await report(Request(scope), request_body(scope), _detail(chunks))
                for m in held:
                    await send(m)
                held.clear()
                return
            await send(message)

        await self.app(scope, receive, send_after_report)
