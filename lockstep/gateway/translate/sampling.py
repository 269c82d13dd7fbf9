"""Sampling: create_sampling_session, GET samplers/{id}, asample -> `Sample`."""

from __future__ import annotations

from lockstep.gateway.errors import bad_request
from lockstep.gateway.schema import requests as rq
from lockstep.gateway.schema import responses as rs
from lockstep.gateway.validate import check_id, parse_tinker_path
from lockstep.v1 import scheduler_pb2 as pb

_INT32_MAX = 2**31 - 1
_UINT64 = 2**64


def create_sampling_session(
    owner: str, body: rq.CreateSamplingSessionRequest
) -> pb.CreateSamplingSessionRequest:
    check_id("session_id", body.session_id)
    if body.model_path is None and not body.base_model:
        raise bad_request("model_path", "give a model_path or a base_model")
    model_path = None
    if body.model_path is not None:
        model_path = str(parse_tinker_path("model_path", body.model_path))
    return pb.CreateSamplingSessionRequest(
        owner=owner,
        session_id=body.session_id,
        sampling_session_seq_id=body.sampling_session_seq_id,
        model_path=model_path,
        base_model=body.base_model or None,
    )


def sampler_info(info: pb.SamplerInfo) -> rs.GetSamplerResponse:
    return rs.GetSamplerResponse(
        sampler_id=info.sampler_id,
        base_model=info.base_model,
        model_path=info.model_path if info.HasField("model_path") else None,
    )


def _prompt_tokens(prompt: rq.ModelInput) -> list[int]:
    tokens: list[int] = []
    for i, chunk in enumerate(prompt.chunks):
        if not isinstance(chunk, rq.EncodedTextChunk):
            raise bad_request(
                f"prompt.chunks[{i}]",
                f"chunk type {chunk.type!r} is not supported for sampling (encoded_text only)",
            )
        tokens.extend(chunk.tokens)
    if not tokens:
        raise bad_request("prompt", "must contain at least one token")
    if min(tokens) < 0 or max(tokens) > _INT32_MAX:
        raise bad_request("prompt", "token ids must be in [0, 2^31)")
    return tokens


def _params(p: rq.SamplingParams) -> pb.SamplingParams:
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
            elif 0 <= value <= _INT32_MAX:
                out.stop_tokens.append(value)
            else:
                raise bad_request("sampling_params.stop", "stop token ids must be in [0, 2^31)")
    return out


def sample(owner: str, body: rq.SampleRequest) -> pb.SubmitRequest:
    if body.sampling_session_id is None:
        raise bad_request("sampling_session_id", "field required (create a sampling session first)")
    check_id("sampling_session_id", body.sampling_session_id)
    if body.seq_id is None:
        raise bad_request("seq_id", "field required")
    if body.target_prompt_logprobs is not None:
        raise bad_request("target_prompt_logprobs", "not supported by this server")
    if body.prompt_alt_tokens_k:
        raise bad_request("prompt_alt_tokens_k", "not supported by this server")
    # record_stability_info is accepted and records nothing: it only feeds stable_reinforce,
    # which this server refuses with a 400 (lockstep.engine.losses.UNSUPPORTED_LOSSES).
    tokens = _prompt_tokens(body.prompt)
    want_prompt_logprobs = bool(body.prompt_logprobs)
    if body.prompt_logprobs_last_n is not None:
        if not (want_prompt_logprobs or body.topk_prompt_logprobs):
            raise bad_request("prompt_logprobs_last_n", "requires prompt_logprobs")
        if body.prompt_logprobs_last_n > len(tokens) - 1:
            raise bad_request("prompt_logprobs_last_n", "must be <= len(prompt) - 1")
    op = pb.Sample(
        sampling_session_id=body.sampling_session_id,
        seq_id=body.seq_id,
        prompt_tokens=tokens,
        num_samples=body.num_samples,
        params=_params(body.sampling_params),
        prompt_logprobs=want_prompt_logprobs,
        topk_prompt_logprobs=body.topk_prompt_logprobs,
        topk_sample_logprobs=body.topk_sample_logprobs,
        prompt_logprobs_last_n=body.prompt_logprobs_last_n,
    )
    return pb.SubmitRequest(owner=owner, sample=op)


def sample_future(reply: pb.SubmitReply, num_samples: int) -> rs.SampleFuture:
    """`sample_sequence_ids` must have one id per sample (the SDK asserts it)."""
    ids = list(reply.sample_sequence_ids) or [
        f"{reply.request_id}:seq:{i}" for i in range(num_samples)
    ]
    return rs.SampleFuture(request_id=reply.request_id, sample_sequence_ids=ids)
