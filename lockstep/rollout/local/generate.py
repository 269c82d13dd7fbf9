"""Batched generation with a KV cache for already-validated sample requests.

1. Prefill: requests (one row per request, not per sample) are sorted by prompt length and packed
   into left-padded micro-batches under a token budget; each runs one forward that fills its KV
   cache and yields the prompt logprobs (when asked) and the logits of the first new token.
2. Decode: the micro-batch caches are merged into one batch of num_samples rows per request, and
   every step feeds each unfinished row its last token (one position, explicit position ids).
   Finished rows leave the batch; leading all-padding columns are trimmed.

Logprobs are `log_softmax` of the raw fp32 logits (the model's own distribution at temperature 1),
whatever the sampling temperature / top-k / top-p.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, PreTrainedModel

from lockstep.engine.types import SampledSequence, SampleRequest, SampleResult, StopReason
from lockstep.modeling.lora import LoraModel
from lockstep.rollout.local.kvcache import BatchCache, merge
from lockstep.rollout.local.sampling import (
    RowSampling,
    choose_tokens,
    make_generator,
    topk_logprobs,
)
from lockstep.rollout.local.stops import Decode, StopChecker


@dataclass(frozen=True)
class GenerateConfig:
    eos_ids: frozenset[int]
    pad_id: int
    decode: Decode
    prefill_token_budget: int = 8192  # padded prompt tokens per prefill forward
    max_logits_elements: int = 1 << 27  # [rows, T, V] fp32 logits kept by one prefill forward


@dataclass
class _Row:
    adapter_id: str | None
    prompt_len: int
    sampling: RowSampling
    stop: StopChecker
    topk: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    topk_ids: list[list[int]] = field(default_factory=list)
    topk_lps: list[list[float]] = field(default_factory=list)
    stop_reason: StopReason = "length"

    def sequence(self) -> SampledSequence:
        return SampledSequence(
            tokens=self.tokens,
            logprobs=self.logprobs,
            stop_reason=self.stop_reason,
            topk_ids=self.topk_ids if self.topk > 0 else None,
            topk_logprobs=self.topk_lps if self.topk > 0 else None,
        )


def _wants_prompt_scores(req: SampleRequest) -> bool:
    return req.prompt_logprobs or req.topk_prompt_logprobs > 0


def _micro_batches(
    requests: Sequence[SampleRequest], vocab: int, cfg: GenerateConfig
) -> list[list[int]]:
    order = sorted(range(len(requests)), key=lambda i: len(requests[i].prompt))
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        trial = current + [i]
        width = max(len(requests[j].prompt) for j in trial)
        full = any(_wants_prompt_scores(requests[j]) for j in trial)
        tokens = len(trial) * width
        too_big = tokens > cfg.prefill_token_budget or (
            full and tokens * vocab > cfg.max_logits_elements
        )
        if current and too_big:
            batches.append(current)
            current = [i]
        else:
            current = trial
    if current:
        batches.append(current)
    return batches


def _prompt_scores(
    req: SampleRequest, logits: torch.Tensor, result: SampleResult
) -> None:
    """Fill prompt logprobs / top-k from `logits` [L, V] (row i predicts prompt token i + 1)."""
    n = len(req.prompt)
    start = 1 if req.prompt_logprobs_last_n is None else max(1, n - req.prompt_logprobs_last_n)
    if req.prompt_logprobs:
        result.prompt_logprobs = [math.nan] * n
    if req.topk_prompt_logprobs > 0:
        result.topk_prompt = [None] * n
    if start >= n:
        return
    lp = torch.log_softmax(logits[start - 1 : n - 1].float(), dim=-1)
    if req.prompt_logprobs:
        targets = torch.tensor(req.prompt[start:], dtype=torch.long, device=lp.device)
        values = lp.gather(-1, targets.unsqueeze(-1)).squeeze(-1).cpu().tolist()
        assert result.prompt_logprobs is not None
        result.prompt_logprobs[start:] = values
    if req.topk_prompt_logprobs > 0:
        ids, lps = topk_logprobs(lp, req.topk_prompt_logprobs)
        assert result.topk_prompt is not None
        for offset, (row_ids, row_lps) in enumerate(zip(ids, lps, strict=True)):
            result.topk_prompt[start + offset] = list(zip(row_ids, row_lps, strict=True))


class Generator:
    """Runs batches of valid requests through a LoRA-wrapped HF causal LM."""

    def __init__(self, lora: LoraModel, cfg: GenerateConfig) -> None:
        self.lora = lora
        self.model: PreTrainedModel = lora.base
        self.cfg = cfg
        self.device = next(self.model.parameters()).device
        embeddings = self.model.get_input_embeddings()
        assert isinstance(embeddings, torch.nn.Embedding)
        self.vocab = int(embeddings.num_embeddings)

    def _forward(
        self,
        input_ids: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor,
        cache: DynamicCache,
        adapters: Sequence[str | None],
        logits_to_keep: int,
        valid: torch.Tensor | None,
    ) -> torch.Tensor:
        with self.lora.row_adapters(adapters, valid=valid):
            out = self.model(
                input_ids=input_ids,
                attention_mask=mask,
                position_ids=positions,
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=logits_to_keep,
            )
        return out.logits.float()

    def _prefill(
        self, requests: Sequence[SampleRequest], batch: list[int], results: list[SampleResult]
    ) -> tuple[BatchCache, torch.Tensor]:
        """Prefill one micro-batch; returns its cache and last-position logits [b, V]."""
        width = max(len(requests[i].prompt) for i in batch)
        ids = torch.full((len(batch), width), self.cfg.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, i in enumerate(batch):
            prompt = requests[i].prompt
            ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            mask[row, width - len(prompt) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(dim=-1) - 1).clamp_(min=0)
        full = any(_wants_prompt_scores(requests[i]) for i in batch)
        cache = DynamicCache(config=self.model.config)
        logits = self._forward(
            ids,
            mask,
            positions,
            cache,
            [requests[i].adapter_id for i in batch],
            logits_to_keep=0 if full else 1,
            valid=mask.bool(),
        )
        for row, i in enumerate(batch):
            req = requests[i]
            if _wants_prompt_scores(req):
                _prompt_scores(req, logits[row, width - len(req.prompt) :], results[i])
        return BatchCache(cache, mask), logits[:, -1, :].clone()  # frees full prompt logits

    def run(self, requests: Sequence[SampleRequest]) -> list[SampleResult]:
        results = [SampleResult(request_id=r.request_id, sequences=[]) for r in requests]
        parts: list[BatchCache] = []
        part_logits: list[torch.Tensor] = []
        rows: list[_Row] = []
        where: list[tuple[int, int]] = []  # (part, row in part) of each decode row
        per_request: list[list[_Row]] = [[] for _ in requests]
        for batch in _micro_batches(requests, self.vocab, self.cfg):
            cache, last = self._prefill(requests, batch, results)
            parts.append(cache)
            part_logits.append(last)
            for part_row, i in enumerate(batch):
                for s in range(requests[i].num_samples):
                    row = self._new_row(requests[i], s)
                    per_request[i].append(row)
                    if requests[i].params.max_tokens > 0:
                        rows.append(row)
                        where.append((len(parts) - 1, part_row))
        if rows:
            first_logits = torch.stack([part_logits[p][r] for p, r in where])
            merged = merge(parts, where, self.model.config)
            parts.clear()  # the merged copy is the only cache from here on
            self._decode(merged, rows, first_logits)
        for i, req_rows in enumerate(per_request):
            results[i].sequences = [row.sequence() for row in req_rows]
        return results

    def _new_row(self, req: SampleRequest, sample: int) -> _Row:
        p = req.params
        gen = make_generator(p.seed, sample) if p.temperature > 0 else None
        return _Row(
            adapter_id=req.adapter_id,
            prompt_len=len(req.prompt),
            sampling=RowSampling(p.temperature, p.top_k, p.top_p, gen),
            stop=StopChecker(p, self.cfg.eos_ids, self.cfg.decode),
            topk=req.topk_sample_logprobs,
        )

    def _decode(self, batch: BatchCache, rows: list[_Row], logits: torch.Tensor) -> None:
        while True:
            tokens = choose_tokens(logits, [r.sampling for r in rows])
            lp = torch.log_softmax(logits, dim=-1)
            token_lp = lp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).cpu().tolist()
            token_ids = tokens.cpu().tolist()
            k = max(r.topk for r in rows)
            top_ids, top_lps = topk_logprobs(lp, k) if k > 0 else ([], [])
            keep: list[int] = []
            for j, row in enumerate(rows):
                row.tokens.append(int(token_ids[j]))
                row.logprobs.append(float(token_lp[j]))
                if row.topk > 0:
                    row.topk_ids.append(top_ids[j][: row.topk])
                    row.topk_lps.append(top_lps[j][: row.topk])
                reason = row.stop.check(row.tokens)
                if reason is None:
                    keep.append(j)
                else:
                    row.stop_reason = reason
            if not keep:
                return
            if len(keep) < len(rows):
                index = torch.tensor(keep, dtype=torch.long, device=self.device)
                batch.select(index)
                tokens = tokens.index_select(0, index)
                rows = [rows[j] for j in keep]
                batch.trim_padding()
            mask = batch.append_real_column()
            positions = torch.tensor(
                [[r.prompt_len + len(r.tokens) - 1] for r in rows],
                dtype=torch.long,
                device=self.device,
            )
            logits = self._forward(
                tokens.unsqueeze(-1),
                mask,
                positions,
                batch.cache,
                [r.adapter_id for r in rows],
                logits_to_keep=1,
                valid=None,
            )[:, -1, :]

