"""Checks every sampling backend applies before a request reaches its model."""

from __future__ import annotations

import math
from collections.abc import Sequence

from lockstep.engine.images import refuse_text_only
from lockstep.engine.types import ModelCard, SampleRequest
from lockstep.errors import UserInputError


def validate_sample_request(req: SampleRequest, card: ModelCard) -> None:
    """Raise UserInputError naming the first bad field of `req` (adapters are not checked)."""
    vocab, context = card.vocab_size, card.max_context_length
    _check_prompt(req.prompt, vocab)
    if req.images and card.vision is None:
        raise refuse_text_only("prompt")
    for i, image in enumerate(req.images):
        placeholders = req.prompt[image.position : image.position + image.tokens]
        if card.vision is not None and placeholders != [card.vision.image_token_id] * image.tokens:
            raise UserInputError(f"images[{i}]", "does not sit on its placeholder tokens")
    if req.num_samples < 1:
        raise UserInputError("num_samples", f"must be >= 1, got {req.num_samples}")
    _check_params(req, context)
    for name, k in (
        ("topk_prompt_logprobs", req.topk_prompt_logprobs),
        ("topk_sample_logprobs", req.topk_sample_logprobs),
    ):
        if not 0 <= k <= vocab:
            raise UserInputError(name, f"must be in [0, {vocab}], got {k}")
    if req.prompt_logprobs_last_n is not None and req.prompt_logprobs_last_n < 0:
        raise UserInputError(
            "prompt_logprobs_last_n", f"must be >= 0, got {req.prompt_logprobs_last_n}"
        )


def _check_prompt(prompt: Sequence[int], vocab: int) -> None:
    if not prompt:
        raise UserInputError("prompt", "must contain at least one token")
    for i, token in enumerate(prompt):
        if token < 0:
            raise UserInputError(f"prompt.tokens[{i}]", f"token id {token} is negative")
        if token >= vocab:
            raise UserInputError(f"prompt.tokens[{i}]", f"token id {token} >= vocab size {vocab}")


def _check_params(req: SampleRequest, context: int) -> None:
    p = req.params
    if p.max_tokens < 0:
        raise UserInputError("sampling_params.max_tokens", f"must be >= 0, got {p.max_tokens}")
    if len(req.prompt) + p.max_tokens > context:
        raise UserInputError(
            "sampling_params.max_tokens",
            f"prompt length {len(req.prompt)} + max_tokens {p.max_tokens} exceeds the "
            f"model's context length {context}",
        )
    if not math.isfinite(p.temperature) or p.temperature < 0:
        raise UserInputError("sampling_params.temperature", f"must be >= 0, got {p.temperature}")
    if p.top_k < -1:
        raise UserInputError("sampling_params.top_k", f"must be -1 or >= 0, got {p.top_k}")
    if not math.isfinite(p.top_p) or not 0.0 < p.top_p <= 1.0:
        raise UserInputError("sampling_params.top_p", f"must be in (0, 1], got {p.top_p}")


def prompt_logprob_start(req: SampleRequest) -> int:
    """First prompt position whose logprob is reported (position 0 never is)."""
    n = len(req.prompt)
    return 1 if req.prompt_logprobs_last_n is None else max(1, n - req.prompt_logprobs_last_n)
