"""sample: queued for the sampling lane (`scheduler/cycle/sampling_lane.py`), which batches every
tenant's samples beside the clock; no model's seq_id order, no cycle phase.

Its engine request and its result encoding are `translate.sample_request` / `sample_response`.
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
    kinds: ClassVar[frozenset[OpKind]] = frozenset({OpKind.SAMPLE})

    async def admit(self, ctx: SubmitContext, req: pb.SubmitRequest) -> SampleClaim:
        s = req.sample
        await ctx.catalog.live_sampler(req.owner, s.sampling_session_id)
        translate.inline_assets(s.prompt_chunks, "prompt", ctx.images)
        prompt, _ = translate.sample_prompt(s, ctx.images)
        if not prompt:
            raise UserInputError("prompt", "is empty")
        last_n = s.prompt_logprobs_last_n if s.HasField("prompt_logprobs_last_n") else None
        if last_n is not None and last_n > len(prompt) - 1:
            raise UserInputError("prompt_logprobs_last_n", "must be <= len(prompt) - 1")
        limits = ctx.limits
        if not 1 <= s.num_samples <= limits.max_samples_per_request:
            raise UserInputError("num_samples", f"must be in [1, {limits.max_samples_per_request}]")
        per_datum = limits.max_tokens_per_datum
        if per_datum and len(prompt) > per_datum:
            raise UserInputError(
                "prompt",
                f"has {len(prompt)} tokens; this server "
                f"accepts at most {per_datum} (max_tokens_per_datum)",
            )
        vocab = ctx.card.vocab_size
        for i, tok in enumerate(prompt):
            if not 0 <= tok < vocab:
                raise UserInputError(
                    f"prompt.tokens[{i}]", f"token id {tok} is outside [0, {vocab})"
                )
        max_tokens = s.params.max_tokens if s.params.HasField("max_tokens") else 16
        if max_tokens < 1:
            raise UserInputError("sampling_params.max_tokens", "must be >= 1")
        if len(prompt) + max_tokens > ctx.card.max_context_length:
            raise UserInputError(
                "sampling_params.max_tokens",
                f"prompt ({len(prompt)}) + max_tokens ({max_tokens}) exceeds the "
                f"context length {ctx.card.max_context_length}",
            )
        for name, value in (("temperature", s.params.temperature), ("top_p", s.params.top_p)):
            finite(value, f"sampling_params.{name}", 0.0)
        return SampleClaim(s.sampling_session_id, s.seq_id, s.num_samples)
