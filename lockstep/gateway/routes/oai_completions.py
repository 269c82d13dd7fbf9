"""OpenAI-compatible `POST /oai/api/v1/completions` (text or token-id prompts, echo, logprobs)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from lockstep.gateway.deps import BearerOwner, Scheduler
from lockstep.gateway.errors import bad_request
from lockstep.gateway.inference import lane
from lockstep.gateway.inference.codec import TextCodec, get_codec
from lockstep.gateway.inference.errors import compat_route, openai_error
from lockstep.gateway.inference.sse import event, new_id, refuse, stream
from lockstep.gateway.schema.openai import CompletionRequest

router = APIRouter(prefix="/oai/api/v1", tags=["openai"], route_class=compat_route(openai_error))


def _logprobs(
    codec: TextCodec,
    tokens: list[int],
    values: list[float | None],
    tops: list[list[tuple[int, float]] | None],
    offset: int,
) -> dict[str, Any]:
    pieces = [codec.piece(t) for t in tokens]
    offsets = []
    for piece in pieces:
        offsets.append(offset)
        offset += len(piece)
    return {
        "tokens": pieces,
        "token_logprobs": values,
        "top_logprobs": [
            None if row is None else {codec.piece(t): v for t, v in row} for row in tops
        ],
        "text_offset": offsets,
    }


def _choice(
    body: CompletionRequest,
    codec: TextCodec,
    index: int,
    prompt_text: str,
    sampled: lane.Sampled,
    seq: lane.Sequence_ | None,
) -> tuple[dict[str, Any], list[int], str]:
    """One choice; also its generated tokens and text (for streaming)."""
    tokens = seq.tokens if seq is not None else []
    done = codec.finish(tokens, body.stops())
    stopped = seq is not None and (seq.stopped or done.stop_string is not None)
    logprobs = None
    if body.logprobs is not None:
        values: list[float | None] = list(seq.logprobs) if seq is not None else []
        tops: list[list[tuple[int, float]] | None] = list(seq.top or []) if seq else []
        all_tokens = list(tokens)
        if body.echo:
            all_tokens = sampled.prompt + all_tokens
            values = list(sampled.prompt_logprobs or [None] * len(sampled.prompt)) + values
            prompt_top = [row or None for row in (sampled.prompt_top or [])]
            tops = (prompt_top or [None] * len(sampled.prompt)) + tops
        tops = tops if body.logprobs > 0 else [None] * len(all_tokens)
        logprobs = _logprobs(codec, all_tokens, values, tops, 0)
    text = (prompt_text if body.echo else "") + done.text
    choice = {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": "stop" if stopped else "length",
    }
    return choice, tokens, done.text


def _events(
    body: CompletionRequest,
    codec: TextCodec,
    head: dict[str, Any],
    choices: list[tuple[dict[str, Any], list[int], str, lane.Sequence_ | None]],
    usage: dict[str, int],
) -> Iterator[str]:
    for choice, tokens, text, seq in choices:
        i = choice["index"]
        if body.echo:
            echoed = choice["text"][: len(choice["text"]) - len(text)]
            yield event({**head, "choices": [_delta(i, echoed, None, None)]})
        for j, piece in enumerate(codec.deltas(tokens, text)):
            lp = None
            if body.logprobs is not None and seq is not None:
                top: list[list[tuple[int, float]] | None] = [None]
                if body.logprobs > 0 and seq.top:
                    top = [seq.top[j]]
                lp = _logprobs(codec, [tokens[j]], [seq.logprobs[j]], top, 0)
            if piece or lp is not None:
                yield event({**head, "choices": [_delta(i, piece, lp, None)]})
        yield event({**head, "choices": [_delta(i, "", None, choice["finish_reason"])]})
    if body.stream_options is not None and body.stream_options.include_usage:
        yield event({**head, "choices": [], "usage": usage})
    yield "data: [DONE]\n\n"


def _delta(index: int, text: str, logprobs: Any, finish: str | None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}


@router.post("/completions", response_model=None)
async def completions(
    body: CompletionRequest, request: Request, owner: BearerOwner, stub: Scheduler
) -> Response:
    refuse(body.unsupported())
    codec = await get_codec(request)
    target = await lane.resolve(request, stub, owner, body.model)
    prompts = body.prompts()
    encoded = [codec.encode(p) if isinstance(p, str) else p for p in prompts]
    if any(not p for p in encoded):
        raise bad_request("prompt", "must contain at least one token")
    max_tokens = 16 if body.max_tokens is None else body.max_tokens
    params = lane.sampling_params(
        max(1, max_tokens),  # 0 = score the prompt only (echo + logprobs)
        body.temperature,
        body.top_p,
        body.top_k,
        body.seed,
        body.stops(),
        codec.eos_ids,
    )
    k = body.logprobs or 0
    want_prompt = body.echo and body.logprobs is not None
    results = await asyncio.gather(
        *(
            lane.sample(request, stub, owner, target, p, body.n, params, k, want_prompt)
            for p in encoded
        )
    )
    built = []
    for pi, (prompt, sampled) in enumerate(zip(prompts, results, strict=True)):
        text = prompt if isinstance(prompt, str) else codec.decode(prompt)
        for si, seq in enumerate(sampled.sequences):
            kept = seq if max_tokens > 0 else None
            choice, tokens, generated = _choice(body, codec, pi * body.n + si, text, sampled, kept)
            built.append((choice, tokens, generated, kept))
    completion_tokens = sum(len(tokens) for _, tokens, _, _ in built)
    prompt_tokens = sum(len(p) for p in encoded)
    usage = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    head = {
        "id": new_id("cmpl-"),
        "object": "text_completion",
        "created": int(time.time()),
        "model": body.model,
    }
    if body.stream:
        return stream(_events(body, codec, head, built, usage))
    return JSONResponse({**head, "choices": [c for c, _, _, _ in built], "usage": usage})
