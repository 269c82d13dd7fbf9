"""Batched generation with a KV cache for already-validated sample requests.

1. Prefill: requests (one row per request, not per sample) are sorted by prompt length and packed
   into left-padded micro-batches under a token budget; each runs one forward that fills its KV
   cache and yields the prompt logprobs (when asked) and the logits of the first new token.
   A request whose session (`cache_namespace`) already prefilled a matching prompt prefix under
   the same adapter reuses that prefix's KV (`prefix_cache`) and prefills only the rest.
2. Decode: the micro-batch caches are merged into one batch of num_samples rows per request, and
   every step feeds each unfinished row its last token (one position, explicit position ids).
   Finished rows leave the batch; leading all-padding columns are trimmed.

With `static_decode` the merged batch decodes over a fixed-capacity cache instead (static shapes,
CUDA graphs on CUDA; finished rows stay until half the batch finished: `static_kv`); it computes
what the step-by-step shrinking batch computes, up to float rounding.

That is the padded path, for models whose every layer is full attention (`padded=True`: the
cache holds plain keys and values, which left padding and row surgery keep exact). Any other
model (sliding windows, sinks, linear attention) takes the grouped path: requests of equal prompt
length prefill together without padding, their samples decode as one batch over HF's own
per-layer caches, and finished rows leave it (`UnpaddedBatch`); no prefix reuse there.

Slices: a `Generation` is a batch of requests prefilled together and decoding; `advance(steps)`
runs at most `steps` decode steps and keeps everything else (cache, rows, their next logits,
sampling generators, stop state) for the next call, so a generation run a slice at a time
computes exactly what one run to the end computes. The local sampler runs long generations in
slices and lets new requests start between them (`LocalSamplingEngine.sample_slice`).

Prompt logprobs are `log_softmax` of the raw fp32 logits (the model's own distribution at
temperature 1). Sampled-token logprobs (and their top-k) are under the distribution each token
was drawn from: temperature, then top-k / top-p truncation and renormalisation (sampling.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel

from lockstep.engine.types import SampleRequest, SampleResult
from lockstep.modeling.lora import LoraModel
from lockstep.modeling.transformers_range import cache_argument
from lockstep.rollout.local.generation import Generation, Live, Row
from lockstep.rollout.local.kvcache import BatchCache, UnpaddedBatch, merge
from lockstep.rollout.local.prefix_cache import Hit, PrefixCache
from lockstep.rollout.local.prompt_images import PromptImages, prompt_key, whole_images
from lockstep.rollout.local.prompts import micro_batches, prompt_scores, wants_prompt_scores
from lockstep.rollout.local.sampling import (
    RowSampling,
    choose_tokens,
    make_generator,
    topk_logprobs,
)
from lockstep.rollout.local.static_kv import StaticBatch, StaticDecoder
from lockstep.rollout.local.stops import Decode, StopChecker


@dataclass(frozen=True)
class GenerateConfig:
    eos_ids: frozenset[int]
    pad_id: int
    decode: Decode
    prefill_token_budget: int = 8192  # padded prompt tokens per prefill forward
    max_logits_elements: int = 1 << 27  # [rows, T, V] fp32 logits kept by one prefill forward
    prefix_cache_sessions: int = 64  # sessions whose prompt KV is kept (0: no prefix reuse)
    prefix_cache_tokens: int = 8192  # cached prompt tokens per session
    prefix_cache_bytes: int = 1 << 30  # cached keys and values of all sessions together
    padded: bool = True  # left-padded shared batches; False: equal-length groups, no padding
    static_decode: bool = False  # padded batches decode over a fixed-capacity cache (static_kv)
    cuda_graphs: bool = False  # ...and replay each batch shape's step as a CUDA graph


class Generator:
    """Runs batches of valid requests through a LoRA-wrapped HF causal LM (and, for a
    vision-language model, its vision tower: `images`)."""

    def __init__(
        self, lora: LoraModel, cfg: GenerateConfig, images: PromptImages | None = None
    ) -> None:
        self.lora = lora
        self.images = images
        self.model: PreTrainedModel = lora.base
        # The KV cache's keyword in this transformers release (the decoder's: image prefills).
        self.cache_arg = cache_argument(self.model)
        self.decoder_cache_arg = (
            cache_argument(self.model.get_decoder()) if images is not None else None
        )
        self.cfg = cfg
        self.device = next(self.model.parameters()).device
        embeddings = self.model.get_input_embeddings()
        assert isinstance(embeddings, torch.nn.Embedding)
        self.vocab = int(embeddings.num_embeddings)
        self.prefix_cache = PrefixCache(
            cfg.prefix_cache_sessions, cfg.prefix_cache_tokens, cfg.prefix_cache_bytes
        )
        self.static = (
            StaticDecoder(lora, cfg.pad_id, cfg.cuda_graphs, self.cache_arg)
            if cfg.static_decode and cfg.padded
            else None
        )
        self.prefilled_tokens = 0  # prompt tokens fed through prefill forwards (the work done)
        self.reused_tokens = 0  # prompt tokens whose KV came from the prefix cache instead

    def _forward(
        self,
        input_ids: torch.Tensor,
        mask: torch.Tensor | None,
        positions: torch.Tensor,
        cache: DynamicCache,
        adapters: Sequence[str | None],
        logits_to_keep: int,
        valid: torch.Tensor | None,
        images: dict[str, Any] | None = None,
    ) -> torch.Tensor:
        """`images`: a prefill's embeddings and M-RoPE positions (`PromptImages.inputs`), fed
        to the language model, whose last hidden states the LM head turns into logits."""
        with self.lora.row_adapters(adapters, valid=valid):
            if images is None:
                out = self.model(
                    input_ids=input_ids,
                    attention_mask=mask,
                    position_ids=positions,
                    use_cache=True,
                    logits_to_keep=logits_to_keep,
                    **{self.cache_arg: cache},
                )
                logits: torch.Tensor = out.logits
            else:
                decoder, head = self.model.get_decoder(), self.model.get_output_embeddings()
                assert isinstance(head, torch.nn.Module) and self.decoder_cache_arg is not None
                past = {self.decoder_cache_arg: cache}
                hidden = decoder(
                    attention_mask=mask, use_cache=True, **past, **images
                ).last_hidden_state
                logits = head(hidden[:, -logits_to_keep:] if logits_to_keep else hidden)
        return logits.float()

    def _images(
        self,
        requests: Sequence[SampleRequest],
        rows: list[tuple[int, int, int]],
        ids: torch.Tensor,
        positions: torch.Tensor,
    ) -> dict[str, Any] | None:
        """A prefill's image input (None: no image in it); rows: (request, first fed column,
        cached prompt tokens) per batch row."""
        if self.images is None:
            return None
        return self.images.inputs(ids, positions, [(requests[i], c, k) for i, c, k in rows])

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
        full = any(wants_prompt_scores(requests[i]) for i in batch)
        cache = DynamicCache(config=self.model.config)
        rows = [(i, width - len(requests[i].prompt), 0) for i in batch]
        logits = self._forward(
            ids,
            mask,
            positions,
            cache,
            [requests[i].adapter_id for i in batch],
            logits_to_keep=0 if full else 1,
            valid=mask.bool(),
            images=self._images(requests, rows, ids, positions),
        )
        for row, i in enumerate(batch):
            req = requests[i]
            if wants_prompt_scores(req):
                prompt_scores(req, logits[row, width - len(req.prompt) :], results[i])
        self.prefilled_tokens += int(mask.sum())
        part = BatchCache(cache, mask)
        self._keep_prefixes(requests, batch, part)
        return part, logits[:, -1, :].clone()  # frees full prompt logits

    # -- prefix reuse within a session ------------------------------------------------------

    def _cacheable(self, req: SampleRequest) -> bool:
        # Prompt scores need every position's logits, so such requests prefill in full.
        return (
            req.cache_namespace is not None
            and self.cfg.prefix_cache_sessions > 0
            and not wants_prompt_scores(req)
        )

    def _keep_prefixes(
        self, requests: Sequence[SampleRequest], batch: list[int], part: BatchCache
    ) -> None:
        """Copy each cacheable row's prompt KV (the row's real columns) into the cache."""
        layers = part.layers_kv()
        for row, i in enumerate(batch):
            req = requests[i]
            if not self._cacheable(req):
                continue
            real = torch.nonzero(part.mask[row], as_tuple=True)[0]
            kv = [(k[row : row + 1, :, real, :], v[row : row + 1, :, real, :]) for k, v in layers]
            assert req.cache_namespace is not None
            self.prefix_cache.store(req.cache_namespace, req.adapter_id, prompt_key(req), kv)

    def _prefill_cached(
        self, requests: Sequence[SampleRequest], hits: list[tuple[int, Hit]]
    ) -> tuple[BatchCache, torch.Tensor]:
        """Prefill requests whose first `hit.length` prompt tokens are cached, in one forward:
        the cached KV is merged (left-padded), and only each prompt's rest is fed, left-padded,
        at its absolute positions. Padding columns are masked out wherever they sit."""
        config = self.model.config
        ones = [torch.ones((1, h.length), dtype=torch.long, device=self.device) for _, h in hits]
        parts = [
            BatchCache(
                DynamicCache(
                    ddp_cache_data=[(k[:, :, : h.length], v[:, :, : h.length]) for k, v in h.kv],
                    config=config,
                ),
                mask,
            )
            for (_, h), mask in zip(hits, ones, strict=True)
        ]
        past = merge(parts, [(j, 0) for j in range(len(parts))], config)
        rests = [requests[i].prompt[h.length :] for i, h in hits]
        width = max(len(r) for r in rests)
        ids = torch.full((len(hits), width), self.cfg.pad_id, dtype=torch.long)
        new = torch.zeros((len(hits), width), dtype=torch.long)
        positions = torch.zeros((len(hits), width), dtype=torch.long)
        for row, ((_, h), rest) in enumerate(zip(hits, rests, strict=True)):
            ids[row, width - len(rest) :] = torch.tensor(rest, dtype=torch.long)
            new[row, width - len(rest) :] = 1
            positions[row, width - len(rest) :] = torch.arange(h.length, h.length + len(rest))
        ids, new, positions = ids.to(self.device), new.to(self.device), positions.to(self.device)
        mask = torch.cat([past.mask, new], dim=1)
        rows = [(i, width - len(r), h.length) for (i, h), r in zip(hits, rests, strict=True)]
        logits = self._forward(
            ids,
            mask,
            positions,
            past.cache,
            [requests[i].adapter_id for i, _ in hits],
            logits_to_keep=1,
            valid=new.bool(),
            images=self._images(requests, rows, ids, positions),
        )
        self.prefilled_tokens += sum(len(r) for r in rests)
        self.reused_tokens += sum(h.length for _, h in hits)
        part = BatchCache(past.cache, mask)
        self._keep_prefixes(requests, [i for i, _ in hits], part)
        return part, logits[:, -1, :].clone()

    def _prefills(
        self, requests: Sequence[SampleRequest], results: list[SampleResult]
    ) -> Iterator[tuple[list[int], BatchCache, torch.Tensor]]:
        """Every request's prefill: cache hits together, the rest in packed micro-batches."""
        rest: list[int] = []
        hits: list[tuple[int, Hit]] = []
        for i, req in enumerate(requests):
            hit = None
            if self._cacheable(req):
                assert req.cache_namespace is not None
                hit = self.prefix_cache.lookup(req.cache_namespace, req.adapter_id, prompt_key(req))
                if hit is not None:  # a prefix never ends inside an image
                    hit.length = whole_images(req, hit.length)
            if hit is None or hit.length == 0:
                rest.append(i)
            else:
                hits.append((i, hit))
        if hits:
            yield ([i for i, _ in hits], *self._prefill_cached(requests, hits))
        subset = [requests[i] for i in rest]
        for batch in micro_batches(
            subset, self.vocab, self.cfg.prefill_token_budget, self.cfg.max_logits_elements
        ):
            picked = [rest[j] for j in batch]
            yield (picked, *self._prefill(requests, picked, results))

    def run(self, requests: Sequence[SampleRequest]) -> list[SampleResult]:
        """Every request to the end, in one go."""
        generation = self.start(requests)
        self.advance(generation, None)
        return generation.results

    def start(self, requests: Sequence[SampleRequest]) -> Generation:
        """Prefill `requests`: a generation ready to decode."""
        if not self.cfg.padded:
            return self._start_grouped(requests)
        results = [SampleResult(request_id=r.request_id, sequences=[]) for r in requests]
        parts: list[BatchCache] = []
        part_logits: list[torch.Tensor] = []
        rows: list[Row] = []
        where: list[tuple[int, int]] = []  # (part, row in part) of each decode row
        per_request: list[list[Row]] = [[] for _ in requests]
        for batch, cache, last in self._prefills(requests, results):
            parts.append(cache)
            part_logits.append(last)
            for part_row, i in enumerate(batch):
                for s in range(requests[i].num_samples):
                    row = self._new_row(requests[i], s)
                    per_request[i].append(row)
                    if requests[i].params.max_tokens > 0:
                        rows.append(row)
                        where.append((len(parts) - 1, part_row))
        lives = []
        if rows:
            first_logits = torch.stack([part_logits[p][r] for p, r in where])
            merged = merge(parts, where, self.model.config)
            parts.clear()  # the merged copy is the only cache from here on
            decoding: BatchCache | StaticBatch | None = None
            if self.static is not None:
                adapters = [r.adapter_id for r in rows]
                decoding = self.static.batch(merged, adapters, max(r.max_tokens for r in rows))
            lives.append(Live(decoding or merged, rows, first_logits))
        return Generation(results, per_request, lives)

    def advance(self, generation: Generation, steps: int | None) -> list[SampleResult]:
        """At most `steps` decode steps of every batch of `generation` (None: to the end); the
        results of the requests that finished."""
        generation.lives = [live for live in generation.lives if not self._decode(live, steps)]
        return generation.done()

    def _start_grouped(self, requests: Sequence[SampleRequest]) -> Generation:
        """Requests of one prompt length at a time, unpadded (module docstring)."""
        results = [SampleResult(request_id=r.request_id, sequences=[]) for r in requests]
        per_request: list[list[Row]] = [
            [self._new_row(r, s) for s in range(r.num_samples)] for r in requests
        ]
        by_length: dict[int, list[int]] = {}
        for i, req in enumerate(requests):
            by_length.setdefault(len(req.prompt), []).append(i)
        lives = []
        for length, members in sorted(by_length.items()):
            per_batch = max(1, self.cfg.prefill_token_budget // length)
            if any(wants_prompt_scores(requests[i]) for i in members):
                per_batch = max(
                    1, min(per_batch, self.cfg.max_logits_elements // (length * self.vocab))
                )
            for at in range(0, len(members), per_batch):
                batch = members[at : at + per_batch]
                live = self._group(requests, batch, length, results, per_request)
                if live is not None:
                    lives.append(live)
        return Generation(results, per_request, lives)

    def _group(
        self,
        requests: Sequence[SampleRequest],
        batch: list[int],
        length: int,
        results: list[SampleResult],
        samples: list[list[Row]],
    ) -> Live | None:
        ids = torch.tensor([requests[i].prompt for i in batch], dtype=torch.long).to(self.device)
        positions = torch.arange(length).expand(len(batch), length).to(self.device)
        full = any(wants_prompt_scores(requests[i]) for i in batch)
        cache = DynamicCache(config=self.model.config)
        logits = self._forward(
            ids,
            None,
            positions,
            cache,
            [requests[i].adapter_id for i in batch],
            logits_to_keep=0 if full else 1,
            valid=None,
            images=self._images(requests, [(i, 0, 0) for i in batch], ids, positions),
        )
        for row, i in enumerate(batch):
            if wants_prompt_scores(requests[i]):
                prompt_scores(requests[i], logits[row], results[i])
        self.prefilled_tokens += len(batch) * length
        rows: list[Row] = []
        source: list[int] = []  # the prefill row each decode row continues
        for part_row, i in enumerate(batch):
            if requests[i].params.max_tokens > 0:
                rows += samples[i]
                source += [part_row] * len(samples[i])
        if not rows:
            return None
        index = torch.tensor(source, dtype=torch.long, device=self.device)
        first_logits = logits[:, -1, :].index_select(0, index)
        batch_cache = UnpaddedBatch(cache)
        batch_cache.select(index)
        return Live(batch_cache, rows, first_logits)

    def _new_row(self, req: SampleRequest, sample: int) -> Row:
        p = req.params
        gen = make_generator(p.seed, sample) if p.temperature > 0 else None
        return Row(
            adapter_id=req.adapter_id,
            prompt_len=len(req.prompt),
            sampling=RowSampling(p.temperature, p.top_k, p.top_p, gen),
            stop=StopChecker(p, self.cfg.eos_ids, self.cfg.decode),
            topk=req.topk_sample_logprobs,
            max_tokens=p.max_tokens,
            done=p.max_tokens <= 0,  # nothing to decode
            delta=0 if self.images is None or not req.images else self.images.delta(req),
        )

    def _decode(self, live: Live, steps: int | None) -> bool:
        """Decode `live` for at most `steps` steps (None: to the end); True once every row
        finished. Between two calls it holds exactly what the next step needs."""
        batch, rows, logits = live.batch, live.rows, live.logits
        taken = 0
        while steps is None or taken < steps:
            taken += 1
            choice = choose_tokens(logits, [r.sampling for r in rows])
            tokens, lp = choice.tokens, choice.logprobs
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
                    row.done = True
            if not keep:
                live.rows = []
                return True
            if len(keep) < len(rows):
                index = torch.tensor(keep, dtype=torch.long, device=self.device)
                if isinstance(batch, StaticBatch):
                    batch.keep(keep)
                else:
                    batch.select(index)
                    batch.trim_padding()
                tokens = tokens.index_select(0, index)
                rows = [rows[j] for j in keep]
            logits = self._step(batch, rows, tokens)
            live.rows, live.logits = rows, logits
        return False

    def _step(
        self, batch: BatchCache | UnpaddedBatch | StaticBatch, rows: list[Row], tokens: torch.Tensor
    ) -> torch.Tensor:
        """Feed each row its last token (int64 [rows]): the next logits, fp32 [rows, V]."""
        positions = torch.tensor(
            [[r.prompt_len + r.delta + len(r.tokens) - 1] for r in rows],
            dtype=torch.long,
            device=self.device,
        )
        if isinstance(batch, StaticBatch):
            return batch.step(tokens, positions)
        return self._forward(
            tokens.unsqueeze(-1),
            batch.append_real_column(),
            positions,
            batch.cache,
            [r.adapter_id for r in rows],
            logits_to_keep=1,
            valid=None,
        )[:, -1, :]
