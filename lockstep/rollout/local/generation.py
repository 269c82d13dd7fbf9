"""A generation's state between decode steps: its rows (one per sample: what it generated, how
it picks and stops), the batches they decode in, and which requests were answered
(`generate.Generator` moves it on)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lockstep.engine.types import SampledSequence, SampleResult, StopReason
from lockstep.rollout.local.kvcache import BatchCache, UnpaddedBatch
from lockstep.rollout.local.sampling import RowSampling
from lockstep.rollout.local.static_kv import StaticBatch
from lockstep.rollout.local.stops import StopChecker


@dataclass
class Row:
    adapter_id: str | None
    prompt_len: int
    sampling: RowSampling
    stop: StopChecker
    topk: int
    max_tokens: int  # the most tokens it may generate (a static batch's capacity)
    delta: int = 0  # M-RoPE: a generated token's position is its index + delta
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    topk_ids: list[list[int]] = field(default_factory=list)
    topk_lps: list[list[float]] = field(default_factory=list)
    stop_reason: StopReason = "length"
    done: bool = False

    def sequence(self) -> SampledSequence:
        return SampledSequence(
            tokens=self.tokens,
            logprobs=self.logprobs,
            stop_reason=self.stop_reason,
            topk_ids=self.topk_ids if self.topk > 0 else None,
            topk_logprobs=self.topk_lps if self.topk > 0 else None,
        )


@dataclass
class Live:
    """Rows decoding in one batch: its cache, its unfinished rows, their next-token logits."""

    batch: BatchCache | UnpaddedBatch | StaticBatch
    rows: list[Row]
    logits: torch.Tensor


@dataclass
class Generation:
    """Requests prefilled together, decoding: `Generator.advance` moves it on."""

    results: list[SampleResult]  # one per request, in order
    samples: list[list[Row]]  # each request's rows (one per sample)
    lives: list[Live]
    answered: set[int] = field(default_factory=set)  # requests whose results were handed out

    @property
    def finished(self) -> bool:
        return len(self.answered) == len(self.results)

    def remaining(self) -> int:
        """Decode steps it may still take: its longest unfinished row's budget left."""
        left = [r.max_tokens - len(r.tokens) for live in self.lives for r in live.rows]
        return max(left, default=0)

    def adapters(self) -> set[str]:
        """Adapters its unfinished rows decode with."""
        return {r.adapter_id for live in self.lives for r in live.rows if r.adapter_id}

    def drop_graphs(self) -> None:
        """Its static batches capture their step again (adapter weights changed)."""
        for live in self.lives:
            if isinstance(live.batch, StaticBatch):
                live.batch.drop_graph()

    def done(self) -> list[SampleResult]:
        """Results of the requests that finished since the last call."""
        out = []
        for i, rows in enumerate(self.samples):
            if i not in self.answered and all(r.done for r in rows):
                self.results[i].sequences = [row.sequence() for row in rows]
                self.answered.add(i)
                out.append(self.results[i])
        return out
