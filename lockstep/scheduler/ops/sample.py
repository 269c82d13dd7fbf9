"""sample: queued for the sampling lane (`scheduler/cycle/sampling_lane.py`), which batches every
tenant's samples beside the clock; no model's seq_id order, no cycle phase.

Validated at submission in its decoded form (`translate.sample_request`: the prompt's tokens,
its images judged); that request is kept (`scheduler/admission/decoded.py`) and the lane runs
it as it is. Its result encoding is `translate.sample_response`.
"""

from __future__ import annotations

from typing import ClassVar

from lockstep.errors import UserInputError
from lockstep.scheduler import translate
from lockstep.scheduler.ops.base import Op, SampleClaim, SubmitContext, finite
from lockstep.v1 import scheduler_pb2 as pb
from lockstep.vocab import OpKind


class Sample(Op):
    oneof = "sample"
    kinds: ClassVar[frozenset[str]] = frozenset({OpKind.SAMPLE})

    async def admit(self, ctx: SubmitContext, req: pb.SubmitRequest) -> SampleClaim:
        """Every rule of a sample, judged here once: the gateway only checks its address and
        the engines trust what is admitted."""
        s = req.sample
        sampler = await ctx.catalog.addressed_sampler(req.owner, s.sampling_session_id)
        translate.inline_assets(s.prompt_chunks, "prompt", ctx.sample_images)
        decoded = translate.sample_request("", s, None, ctx.sample_images)  # its id once claimed
        prompt = decoded.prompt  # images become their tokens
        limits = ctx.limits
        if not 1 <= s.num_samples <= limits.max_samples_per_request:
            raise UserInputError("num_samples", f"must be in [1, {limits.max_samples_per_request}]")
        _check_prompt(prompt, ctx)
        _check_params(s.params, len(prompt), ctx.card.max_context_length)
        _check_logprobs(s, len(prompt), ctx.card.vocab_size)
        return SampleClaim(
            s.sampling_session_id,
            s.seq_id,
            s.num_samples,
            live_session=sampler.session_id,
            decoded=decoded,
        )


def _check_prompt(prompt: list[int], ctx: SubmitContext) -> None:
    if not prompt:
        raise UserInputError("prompt", "must contain at least one token")
    per_datum = ctx.limits.max_tokens_per_datum
    if per_datum and len(prompt) > per_datum:
        raise UserInputError(
            "prompt",
            f"has {len(prompt)} tokens; this server accepts at most {per_datum} "
            "(max_tokens_per_datum)",
        )
    vocab = ctx.card.vocab_size
    for i, tok in enumerate(prompt):
        if not 0 <= tok < vocab:
            raise UserInputError(f"prompt.tokens[{i}]", f"token id {tok} is outside [0, {vocab})")


def _check_params(p: pb.SamplingParams, prompt: int, context: int) -> None:
    """max_tokens >= 1: the SDK never asks for none (compute_logprobs samples one token), and
    the compatible endpoints ask for one and drop it (`gateway/routes/oai_completions.py`)."""
    max_tokens = translate.max_tokens(p)
    if max_tokens < 1:
        raise UserInputError("sampling_params.max_tokens", f"must be >= 1, got {max_tokens}")
    if prompt + max_tokens > context:
        raise UserInputError(
            "sampling_params.max_tokens",
            f"prompt ({prompt}) + max_tokens ({max_tokens}) exceeds the context length {context}",
        )
    finite(p.temperature, "sampling_params.temperature", 0.0)
    finite(p.top_p, "sampling_params.top_p")
    if not 0.0 < p.top_p <= 1.0:
        raise UserInputError("sampling_params.top_p", f"must be in (0, 1], got {p.top_p}")
    if p.top_k < -1:
        raise UserInputError("sampling_params.top_k", f"must be -1 or >= 0, got {p.top_k}")
    for token in p.stop_tokens:
        if token < 0:
            raise UserInputError("sampling_params.stop", f"token id {token} is negative")


def _check_logprobs(s: pb.Sample, prompt: int, vocab: int) -> None:
    for name, k in (
        ("topk_prompt_logprobs", s.topk_prompt_logprobs),
        ("topk_sample_logprobs", s.topk_sample_logprobs),
    ):
        if not 0 <= k <= vocab:
            raise UserInputError(name, f"must be in [0, {vocab}], got {k}")
    if not s.HasField("prompt_logprobs_last_n"):
        return
    if not (s.prompt_logprobs or s.topk_prompt_logprobs):
        raise UserInputError("prompt_logprobs_last_n", "requires prompt_logprobs")
    if not 1 <= s.prompt_logprobs_last_n <= prompt - 1:
        raise UserInputError("prompt_logprobs_last_n", "must be in [1, len(prompt) - 1]")
