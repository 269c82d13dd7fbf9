"""A compatible-route request on the Tinker sampling path: sampler session, `Sample`, future.

`model` is a served base model name, a `tinker://<run>/sampler_weights/<name>` path (any
readable checkpoint path), or `<base model>;<path>`. Each request gets its own sampler session
(as a tinker `SamplingClient` would), created in one gateway-owned Tinker session per owner;
the scheduler applies its ownership rules there (a foreign, unpublished or missing checkpoint is
a 404). Samplers of one checkpoint share one adapter id, so the engine loads it once.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
from fastapi import Request

from lockstep.gateway.deps import CALL_TIMEOUT_S
from lockstep.gateway.errors import ApiError, bad_request
from lockstep.v1 import scheduler_pb2 as pb
from lockstep.wire.v1 import tinker_pb2 as wire

_UINT64 = 2**64
_TOPK_MISSING = -9999.0  # the scheduler pads top-k rows with -99999 ("not computed")


@dataclass
class Sequence_:
    tokens: list[int]
    logprobs: list[float]
    stopped: bool  # the engine stopped it (EOS / stop string / stop token), not max_tokens
    top: list[list[tuple[int, float]]] | None = None  # per token, best first


@dataclass
class Sampled:
    prompt: list[int]
    sequences: list[Sequence_]
    prompt_logprobs: list[float | None] | None = None
    prompt_top: list[list[tuple[int, float]]] | None = None


@dataclass(frozen=True)
class Target:
    sampler_id: str
    base_model: str
    context_length: int

    def room(self, prompt: list[int] | int) -> int:
        """Tokens left after `prompt` (or that many tokens): the default max_tokens where a
        route has none."""
        length = prompt if isinstance(prompt, int) else len(prompt)
        return max(1, self.context_length - length)


@dataclass
class _Sessions:
    """The gateway's own Tinker session of each owner; sampler ids count up within it."""

    by_owner: dict[str, str] = field(default_factory=dict)
    seq: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


def new_sessions() -> _Sessions:
    return _Sessions()


async def served_models(stub: Any) -> dict[str, int]:
    """Served base model name -> its context length."""
    caps = await stub.GetServerCapabilities(pb.CapabilitiesRequest(), timeout=CALL_TIMEOUT_S)
    return {m.model_name: int(m.max_context_length) for m in caps.models}


def split_model(model: str) -> tuple[str | None, str | None]:
    """`model` -> (base model, checkpoint path)."""
    base, sep, path = model.partition(";")
    if sep:
        return base.strip() or None, path.strip() or None
    if model.startswith("tinker://"):
        return None, model
    return model, None


async def _session(request: Request, stub: Any, owner: str, fresh: bool) -> str:
    sessions: _Sessions = request.app.state.compat_sessions
    async with sessions.lock:
        if fresh or owner not in sessions.by_owner:
            reply = await stub.CreateSession(
                pb.CreateSessionRequest(owner=owner, tags=["compat-api"]), timeout=CALL_TIMEOUT_S
            )
            sessions.by_owner[owner] = reply.session_id
        return sessions.by_owner[owner]


async def resolve(request: Request, stub: Any, owner: str, model: str) -> Target:
    """A new sampler session for `model` (404 when it names nothing this caller may sample)."""
    base, path = split_model(model)
    served = await served_models(stub)
    if base is not None and base not in served:
        raise ApiError(404, f"model: {base!r} is not served here")
    if path is not None and not path.startswith("tinker://"):
        raise bad_request("model", "a checkpoint must be a tinker:// path")
    for attempt in range(2):
        session = await _session(request, stub, owner, fresh=attempt > 0)
        sessions: _Sessions = request.app.state.compat_sessions
        ask = pb.CreateSamplingSessionRequest(
            owner=owner, session_id=session, sampling_session_seq_id=next(sessions.seq)
        )
        if path is not None:
            ask.model_path = path
        else:
            ask.base_model = model
        try:
            info = await stub.CreateSamplingSession(ask, timeout=CALL_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            lost = exc.code() == grpc.StatusCode.NOT_FOUND and "session" in (exc.details() or "")
            if lost and attempt == 0:
                continue  # our session is gone (expired, or Redis was reset): make a new one
            if exc.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.PERMISSION_DENIED):
                raise ApiError(404, f"model: {exc.details() or 'not found'}") from exc
            raise
        if base is not None and info.base_model != base:
            raise bad_request("model", f"{path} was trained on {info.base_model}, not {base}")
        return Target(info.sampler_id, info.base_model, served.get(info.base_model, 2048))
    raise AssertionError("unreachable")


def sampling_params(
    max_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
    seed: int | None,
    stops: list[str],
    eos_ids: tuple[int, ...],
) -> pb.SamplingParams:
    """Compatible-route semantics: always stop at EOS, and at any stop string (both kept in the
    engine's output; the route cuts the text)."""
    params = pb.SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        has_stop=True,
        stop_strings=stops,
        stop_tokens=list(eos_ids),
    )
    if seed is not None:
        params.seed = seed % _UINT64
    return params


def _topk(msg: wire.TopkLogprobs) -> list[list[tuple[int, float]]]:
    if msg.k == 0 or msg.length == 0:
        return []
    ids = np.frombuffer(msg.token_ids, dtype="<i4").reshape(msg.length, msg.k)
    lps = np.frombuffer(msg.logprobs, dtype="<f4").reshape(msg.length, msg.k)
    return [
        [(int(t), float(v)) for t, v in zip(r_ids, r_lps, strict=True) if v > _TOPK_MISSING]
        for r_ids, r_lps in zip(ids, lps, strict=True)
    ]


def _decode(prompt: list[int], out: wire.SampleResponse) -> Sampled:
    sequences = []
    for seq in out.sequences:
        s = Sequence_(
            tokens=np.frombuffer(seq.tokens, dtype="<i4").tolist(),
            logprobs=np.frombuffer(seq.logprobs, dtype="<f4").tolist(),
            stopped=seq.stop_reason == wire.STOP_REASON_STOP,
        )
        if seq.HasField("topk_sampled_logprobs"):
            s.top = _topk(seq.topk_sampled_logprobs)
        sequences.append(s)
    result = Sampled(prompt, sequences)
    if out.HasField("prompt_logprobs"):
        values = np.frombuffer(out.prompt_logprobs, dtype="<f4").tolist()
        result.prompt_logprobs = [None if np.isnan(v) else v for v in values]
    if out.HasField("topk_prompt_logprobs"):
        result.prompt_top = _topk(out.topk_prompt_logprobs)
    return result


async def sample(
    request: Request,
    stub: Any,
    owner: str,
    target: Target,
    prompt: list[int],
    num_samples: int,
    params: pb.SamplingParams,
    topk: int = 0,
    prompt_logprobs: bool = False,
    chunks: list[wire.Chunk] | None = None,
) -> Sampled:
    """Submit one `Sample` and wait for its future (the same path as `/api/v1/asample`).
    `chunks`: the prompt with images, as text and image chunks (`inference/images.py`)."""
    if not prompt:
        raise bad_request("prompt", "must contain at least one token")
    op = pb.Sample(
        sampling_session_id=target.sampler_id,
        seq_id=1,
        prompt_tokens=[] if chunks else prompt,
        prompt_chunks=chunks or [],
        num_samples=num_samples,
        params=params,
        prompt_logprobs=prompt_logprobs,
        topk_prompt_logprobs=topk if prompt_logprobs else 0,
        topk_sample_logprobs=topk,
    )
    reply = await stub.Submit(pb.SubmitRequest(owner=owner, sample=op), timeout=CALL_TIMEOUT_S)
    wait = request.app.state.settings.long_poll_seconds
    while True:
        try:
            future = await stub.RetrieveFuture(
                pb.RetrieveFutureRequest(
                    owner=owner, request_id=reply.request_id, timeout_seconds=wait
                ),
                timeout=wait + 10.0,
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (
                grpc.StatusCode.DEADLINE_EXCEEDED,
                grpc.StatusCode.UNAVAILABLE,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
            ):
                await asyncio.sleep(0.5)  # the scheduler restarts or is slow: the job persists
                continue
            raise
        state = future.WhichOneof("state")
        if state == "result":
            return _decode(prompt, future.result.sample)
        if state == "error":
            status = 400 if future.error.category == "user" else 500
            raise ApiError(status, future.error.message or "sampling failed")
