"""Anthropic-compatible `POST /anthropic/api/v1/messages` and `/v1/messages/count_tokens`.

A conversation ending with an assistant turn is continued (Anthropic's prefill): the template
leaves that turn open and the reply holds only the new text.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from lockstep.gateway.deps import CALL_TIMEOUT_S, BearerOwner, Scheduler
from lockstep.gateway.errors import ApiError
from lockstep.gateway.inference import images, lane
from lockstep.gateway.inference.codec import TextCodec, get_codec
from lockstep.gateway.inference.errors import anthropic_error, compat_route
from lockstep.gateway.inference.images import ChatImage
from lockstep.gateway.inference.sse import event, new_id, refuse, stream
from lockstep.gateway.schema.anthropic import CountTokensRequest, MessagesRequest
from lockstep.v1 import scheduler_pb2 as pb

router = APIRouter(
    prefix="/anthropic/api/v1", tags=["anthropic"], route_class=compat_route(anthropic_error)
)


def _prompt(
    codec: TextCodec, body: MessagesRequest | CountTokensRequest
) -> tuple[list[int], list[ChatImage]]:
    if body.tools:
        refuse(["tools"])
    messages, pictures = images.anthropic_chat(body)
    final = body.messages[-1].role == "assistant"
    return codec.encode_chat(messages, continue_final=final), pictures


def _events(
    message: dict[str, Any], codec: TextCodec, tokens: list[int], text: str
) -> Iterator[str]:
    start = {
        **message,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {**message["usage"], "output_tokens": 0},
    }
    yield event({"type": "message_start", "message": start}, "message_start")
    block = {
        "type": "content_block_start",
        "index": 0,
        "content_block": {"type": "text", "text": ""},
    }
    yield event(block, "content_block_start")
    for piece in codec.deltas(tokens, text):
        if piece:
            delta = {"type": "text_delta", "text": piece}
            yield event(
                {"type": "content_block_delta", "index": 0, "delta": delta}, "content_block_delta"
            )
    yield event({"type": "content_block_stop", "index": 0}, "content_block_stop")
    end = {"stop_reason": message["stop_reason"], "stop_sequence": message["stop_sequence"]}
    usage = {"output_tokens": message["usage"]["output_tokens"]}
    yield event({"type": "message_delta", "delta": end, "usage": usage}, "message_delta")
    yield event({"type": "message_stop"}, "message_stop")


@router.post("/messages", response_model=None)
async def messages(
    body: MessagesRequest, request: Request, owner: BearerOwner, stub: Scheduler
) -> Response:
    codec = await get_codec(request)
    target = await lane.resolve(request, stub, owner, body.model)
    prompt, pictures = _prompt(codec, body)
    chunks = images.chunks(prompt, codec.placeholder, pictures) if pictures else None
    stops = list(body.stop_sequences or [])
    params = lane.sampling_params(
        body.max_tokens, body.temperature, body.top_p, body.top_k, None, stops, codec.eos_ids
    )
    sampled = await lane.sample(request, stub, owner, target, prompt, 1, params, chunks=chunks)
    (seq,) = sampled.sequences
    done = codec.finish(seq.tokens, stops)
    if done.stop_string is not None:
        reason = "stop_sequence"
    else:
        reason = "end_turn" if seq.stopped else "max_tokens"
    message = {
        "id": new_id("msg_"),
        "type": "message",
        "role": "assistant",
        "model": body.model,
        "content": [{"type": "text", "text": done.text}],
        "stop_reason": reason,
        "stop_sequence": done.stop_string,
        "usage": {
            "input_tokens": len(prompt) + codec.image_tokens(pictures),
            "output_tokens": len(seq.tokens),
        },
    }
    if body.stream:
        return stream(_events(message, codec, seq.tokens, done.text))
    return JSONResponse(message)


@router.post("/messages/count_tokens")
async def count_tokens(
    body: CountTokensRequest, request: Request, owner: BearerOwner, stub: Scheduler
) -> dict[str, int]:
    codec = await get_codec(request)
    base, path = lane.split_model(body.model)
    if base is not None and base not in await lane.served_models(stub):
        raise ApiError(404, f"model: {base!r} is not served here")
    if path is not None:  # readable by this caller (own, or published), else 404
        ref = pb.CheckpointRef(owner=owner, tinker_path=path)
        await stub.GetWeightsInfo(ref, timeout=CALL_TIMEOUT_S)
    prompt, pictures = _prompt(codec, body)
    images.chunks(prompt, codec.placeholder, pictures)  # every image placed, or a 400
    return {"input_tokens": len(prompt) + codec.image_tokens(pictures)}
