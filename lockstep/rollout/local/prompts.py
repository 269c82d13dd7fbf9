"""Prefill helpers of the local sampler: how prompts are cut into prefill micro-batches, and
prompt logprobs (and their top-k) from a prefill's logits."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from lockstep.engine.types import SampleRequest, SampleResult
from lockstep.rollout.local.sampling import topk_logprobs
from lockstep.training.logprobs import chunk_tokens


def wants_prompt_scores(req: SampleRequest) -> bool:
    return req.prompt_logprobs or req.topk_prompt_logprobs > 0


def micro_batches(
    requests: Sequence[SampleRequest], vocab: int, token_budget: int, max_logits_elements: int
) -> list[list[int]]:
    """Requests (by index) in prefill micro-batches: shortest prompts first, each batch at most
    `token_budget` padded prompt tokens, and its prompt logits (when any request wants prompt
    scores) at most `max_logits_elements`."""
    order = sorted(range(len(requests)), key=lambda i: len(requests[i].prompt))
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        trial = current + [i]
        width = max(len(requests[j].prompt) for j in trial)
        full = any(wants_prompt_scores(requests[j]) for j in trial)
        tokens = len(trial) * width
        too_big = tokens > token_budget or (full and tokens * vocab > max_logits_elements)
        if current and too_big:
            batches.append(current)
            current = [i]
        else:
            current = trial
    if current:
        batches.append(current)
    return batches


def prompt_scores(
    req: SampleRequest, logits: torch.Tensor, result: SampleResult, chunk: int | None = None
) -> None:
    """Fill prompt logprobs / top-k from `logits` [L, V] (row i predicts prompt token i + 1)."""
    n = len(req.prompt)
    start = req.prompt_logprob_start
    if req.prompt_logprobs:
        result.prompt_logprobs = [math.nan] * n
    if req.topk_prompt_logprobs > 0:
        result.topk_prompt = [None] * n
    if start >= n:
        return
    # fp32 log-softmax in position chunks: never a second [L, V] fp32 copy of the logits.
    step = chunk or chunk_tokens(logits.shape[-1])
    for at in range(start, n, step):
        end = min(n, at + step)
        lp = torch.log_softmax(logits[at - 1 : end - 1].float(), dim=-1)
        if req.prompt_logprobs:
            targets = torch.tensor(req.prompt[at:end], dtype=torch.long, device=lp.device)
            values = lp.gather(-1, targets.unsqueeze(-1)).squeeze(-1).cpu().tolist()
            assert result.prompt_logprobs is not None
            result.prompt_logprobs[at:end] = values
        if req.topk_prompt_logprobs > 0:
            ids, lps = topk_logprobs(lp, req.topk_prompt_logprobs)
            assert result.topk_prompt is not None
            for offset, (row_ids, row_lps) in enumerate(zip(ids, lps, strict=True)):
                result.topk_prompt[at + offset] = list(zip(row_ids, row_lps, strict=True))
