"""OpenAI-compatible `POST /oai/api/v1/chat/completions` (the model's own chat template)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from lockstep.gateway.deps import BearerOwner, Scheduler
from lockstep.gateway.inference import images, lane
from lockstep.gateway.inference.codec import TextCodec, get_codec
from lockstep.gateway.inference.errors import compat_route, openai_error
from lockstep.gateway.inference.sse import event, new_id, refuse, stream
from lockstep.gateway.schema.openai import ChatCompletionRequest

router = APIRouter(prefix="/oai/api/v1", tags=["openai"], route_class=compat_route(openai_error))


def _entry(codec: TextCodec, token: int, logprob: float) -> dict[str, Any]:
    piece = codec.piece(token)
    return {"token": piece, "logprob": logprob, "bytes": list(piece.encode())}


def _token_logprobs(codec: TextCodec, seq: lane.Sequence_, j: int, top_n: int) -> dict[str, Any]:
    entry = _entry(codec, seq.tokens[j], seq.logprobs[j])
    top = (seq.top or [])[j][:top_n] if top_n > 0 and seq.top else []
    entry["top_logprobs"] = [_entry(codec, t, v) for t, v in top]
    return entry


def _events(
    body: ChatCompletionRequest,
    codec: TextCodec,
    head: dict[str, Any],
    outs: list[tuple[lane.Sequence_, str, str]],
    usage: dict[str, int],
) -> Iterator[str]:
    top_n = body.top_logprobs or 0
    for i, (seq, text, finish) in enumerate(outs):
        first = {"role": "assistant", "content": ""}
        yield event({**head, "choices": [_delta(i, first, None, None)]})
        for j, piece in enumerate(codec.deltas(seq.tokens, text)):
            lp = {"content": [_token_logprobs(codec, seq, j, top_n)]} if body.logprobs else None
            if piece or lp is not None:
                yield event({**head, "choices": [_delta(i, {"content": piece}, lp, None)]})
        yield event({**head, "choices": [_delta(i, {}, None, finish)]})
    if body.stream_options is not None and body.stream_options.include_usage:
        yield event({**head, "choices": [], "usage": usage})
    yield "data: [DONE]\n\n"


def _delta(index: int, delta: dict[str, Any], logprobs: Any, finish: str | None) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}


@router.post("/chat/completions", response_model=None)
async def chat_completions(
    body: ChatCompletionRequest, request: Request, owner: BearerOwner, stub: Scheduler
) -> Response:
    refuse(body.unsupported())
    codec = await get_codec(request)
    target = await lane.resolve(request, stub, owner, body.model)
    messages, pictures = images.openai_chat(body.messages)
    prompt = codec.encode_chat(messages)
    chunks = images.chunks(prompt, codec.placeholder, pictures) if pictures else None
    prompt_len = len(prompt) + codec.image_tokens(pictures)  # images' placeholders expanded
    limit = body.max_completion_tokens if body.max_completion_tokens is not None else None
    limit = limit if limit is not None else body.max_tokens
    max_tokens = target.room(prompt_len) if limit is None else max(1, limit)
    params = lane.sampling_params(
        max_tokens, body.temperature, body.top_p, body.top_k, body.seed, body.stops(), codec.eos_ids
    )
    top_n = body.top_logprobs or 0
    sampled = await lane.sample(
        request,
        stub,
        owner,
        target,
        prompt,
        body.n,
        params,
        top_n if body.logprobs else 0,
        chunks=chunks,
    )
    outs = []
    for seq in sampled.sequences:
        done = codec.finish(seq.tokens, body.stops())
        finish = "stop" if seq.stopped or done.stop_string is not None else "length"
        outs.append((seq, done.text, finish))
    completion_tokens = sum(len(seq.tokens) for seq, _, _ in outs)
    usage = {
        "prompt_tokens": prompt_len,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_len + completion_tokens,
    }
    head = {
        "id": new_id("chatcmpl-"),
        "object": "chat.completion.chunk" if body.stream else "chat.completion",
        "created": int(time.time()),
        "model": body.model,
    }
    if body.stream:
        return stream(_events(body, codec, head, outs, usage))
    choices = []
    for i, (seq, text, finish) in enumerate(outs):
        logprobs = None
        if body.logprobs:
            logprobs = {
                "content": [_token_logprobs(codec, seq, j, top_n) for j in range(len(seq.tokens))]
            }
        choices.append(
            {
                "index": i,
                "message": {"role": "assistant", "content": text},
                "logprobs": logprobs,
                "finish_reason": finish,
            }
        )
    return JSONResponse({**head, "choices": choices, "usage": usage})
