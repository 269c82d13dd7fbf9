"""asample: samples from a sampling session's weights (no model's seq_id order: the sampling
lane batches every tenant's samples beside the clock). Answered with one sequence id per
sample (the SDK asserts it).

The gateway checks the address and refuses what the contract cannot carry (a prompt of other
chunks than token ids and images, target_prompt_logprobs, prompt_alt_tokens_k, a seed wider than
64 bits);
the rules of everything it carries are the scheduler's (`scheduler/ops/sample.py`).
"""

from __future__ import annotations

from typing import Annotated, ClassVar

from fastapi import Response
from pydantic import Field

from lockstep.gateway.errors import bad_request
from lockstep.gateway.ops.base import GatewayOp, protobuf
from lockstep.gateway.schema import responses as rs
from lockstep.gateway.schema.requests import (
    INT32_MAX,
    INT64_MAX,
    EncodedTextChunk,
    Int32,
    ModelInput,
    NonNegInt,
    SchemaModel,
    TensorData,
)
from lockstep.gateway.translate.chunks import has_images, wire_chunk
from lockstep.gateway.validate import check_id
from lockstep.v1 import scheduler_pb2 as pb

_UINT64 = 2**64


class SamplingParams(SchemaModel):
    max_tokens: Int32 | None = None
    seed: int | None = None
    stop: str | list[str] | list[Int32] | None = None
    temperature: float = 1.0
    top_k: Int32 = -1
    top_p: float = 1.0


class SampleRequest(SchemaModel):
    num_samples: Int32 = 1
    prompt: ModelInput
    sampling_params: SamplingParams
    base_model: str | None = None
    model_path: str | None = None
    sampling_session_id: str | None = None
    seq_id: Annotated[int, Field(ge=0, le=INT64_MAX)] | None = None
    prompt_logprobs: bool | None = None
    topk_prompt_logprobs: Int32 = 0
    topk_sample_logprobs: Int32 = 0
    target_prompt_logprobs: TensorData | None = None
    prompt_alt_tokens_k: NonNegInt = 0
    prompt_logprobs_last_n: Int32 | None = None
    record_stability_info: bool | None = None


def _prompt_tokens(prompt: ModelInput) -> list[int]:
    """The contract carries a sample's prompt as int32 token ids (which ids the model takes is
    the scheduler's to judge)."""
    tokens: list[int] = []
    for i, chunk in enumerate(prompt.chunks):
        if not isinstance(chunk, EncodedTextChunk):
            raise bad_request(
                f"prompt.chunks[{i}]",
                f"chunk type {chunk.type!r} is not supported for sampling (encoded_text only)",
            )
        tokens.extend(chunk.tokens)
    if tokens and (min(tokens) < -INT32_MAX - 1 or max(tokens) > INT32_MAX):
        raise bad_request("prompt", "token ids must fit int32")
    return tokens


def _params(p: SamplingParams) -> pb.SamplingParams:
    out = pb.SamplingParams(
        max_tokens=p.max_tokens,
        temperature=p.temperature,
        top_k=p.top_k,
        top_p=p.top_p,
    )
    if p.seed is not None:
        if not -(2**63) <= p.seed < _UINT64:
            raise bad_request("sampling_params.seed", "must fit in 64 bits")
        out.seed = p.seed % _UINT64  # a negative int64 seed keeps its bits
    if p.stop is not None:
        out.has_stop = True  # present and empty: never stop early (not even at EOS)
        stops = [p.stop] if isinstance(p.stop, str) else p.stop
        for value in stops:
            if isinstance(value, str):
                out.stop_strings.append(value)
            else:
                out.stop_tokens.append(value)
    return out


class Sample(GatewayOp):
    name = "asample"
    path = "/api/v1/asample"
    tag = "sampling"
    oneof = "sample"
    result = "sample"
    sequenced = False
    hot = True
    body: ClassVar[type[SampleRequest]] = SampleRequest
    response_model = rs.SampleFuture

    async def submit_request(self, owner: str, body: SampleRequest) -> pb.SubmitRequest:
        if body.sampling_session_id is None:
            raise bad_request(
                "sampling_session_id", "field required (create a sampling session first)"
            )
        check_id("sampling_session_id", body.sampling_session_id)
        if body.seq_id is None:
            raise bad_request("seq_id", "field required")
        if body.target_prompt_logprobs is not None:
            raise bad_request("target_prompt_logprobs", "not supported by this server")
        if body.prompt_alt_tokens_k:
            raise bad_request("prompt_alt_tokens_k", "not supported by this server")
        # record_stability_info is accepted and records nothing: it only feeds stable_reinforce,
        # which this server refuses with a 400 (lockstep.engine.losses.UNSUPPORTED_LOSSES).
        # A prompt with images goes as its chunks: how many tokens an image is, the scheduler
        # says.
        chunks = body.prompt.chunks
        chunked = has_images(chunks)
        op = pb.Sample(
            sampling_session_id=body.sampling_session_id,
            seq_id=body.seq_id,
            prompt_tokens=[] if chunked else _prompt_tokens(body.prompt),
            prompt_chunks=(
                [wire_chunk(f"prompt.chunks[{i}]", c) for i, c in enumerate(chunks)]
                if chunked
                else []
            ),
            num_samples=body.num_samples,
            params=_params(body.sampling_params),
            prompt_logprobs=bool(body.prompt_logprobs),
            topk_prompt_logprobs=body.topk_prompt_logprobs,
            topk_sample_logprobs=body.topk_sample_logprobs,
            prompt_logprobs_last_n=body.prompt_logprobs_last_n,
        )
        return pb.SubmitRequest(owner=owner, sample=op)

    def response(self, reply: pb.SubmitReply, body: SampleRequest) -> rs.SampleFuture:
        """`sample_sequence_ids` must have one id per sample (the SDK asserts it)."""
        ids = list(reply.sample_sequence_ids) or [
            f"{reply.request_id}:seq:{i}" for i in range(body.num_samples)
        ]
        return rs.SampleFuture(request_id=reply.request_id, sample_sequence_ids=ids)

    def answer(self, result: pb.JobResult, request_type: str | None) -> Response:
        return protobuf(result.sample)
