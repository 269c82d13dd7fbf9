"""Accounting per API key: usage counters by hour and session, and an append-only audit log.

Both live in Redis beside the rest of the state (`state/ledger.py`). Usage is a hash per
(owner, UTC hour) of `<session>|<base_model>|<counter>` -> amount, written by the clock
(training) and the sampling lane (samples); a range query reads the hours it covers. The audit
log is a Redis stream per owner (XADD only: entries are never edited), trimmed by age to the
retention.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from cachetools import LRUCache

from lockstep.engine.types import SampleRequest, SampleResult
from lockstep.scheduler.ops import registry
from lockstep.scheduler.state.batch import WriteBatch
from lockstep.scheduler.state.jobs import Job
from lockstep.scheduler.state.store import Store
from lockstep.v1 import scheduler_pb2 as pb
from lockstep.vocab import AuditEvent

if TYPE_CHECKING:
    from lockstep.scheduler.planner import CyclePlan
    from lockstep.scheduler.state.outcome import Outcome

HOUR_S = 3600
OWNERS_KEPT = 4096


class Counter(StrEnum):
    TOKENS_TRAINED = "tokens_trained"
    TOKENS_PREFILL = "tokens_prefill"
    TOKENS_SAMPLED = "tokens_sampled"
    STEPS = "steps"
    SAMPLES = "samples"
    CYCLE_SECONDS = "cycle_seconds"
    CHECKPOINTS = "checkpoints"
    CUSTOM_LOSSES = "custom_losses"


class Accounting:
    def __init__(self, store: Store, retention_s: float) -> None:
        self.ledger = store.ledger
        self.store = store
        self.retention_s = retention_s
        # Who a model or sampler belongs to (immutable once created): read once each, the most
        # recently used kept (an RL run makes a sampler per step: the memory stays bounded).
        self._models: LRUCache[str, tuple[str, str, str]] = LRUCache(OWNERS_KEPT)
        self._samplers: LRUCache[str, tuple[str, str]] = LRUCache(OWNERS_KEPT)

    # ---------------------------------------------------------------- usage
    async def add(
        self, owner: str, session_id: str, base_model: str, counts: dict[Counter, float]
    ) -> None:
        async with self.store.batch() as batch:
            self._add(batch, owner, session_id, base_model, counts)

    def _add(
        self,
        batch: WriteBatch,
        owner: str,
        session_id: str,
        base_model: str,
        counts: dict[Counter, float],
    ) -> None:
        """Queue one usage increment on `batch` (a caller's batch: one round trip for all)."""
        amounts = {f"{session_id}|{base_model}|{c}": amount for c, amount in counts.items()}
        hour = int(time.time() // HOUR_S)
        batch.usage(owner, hour, amounts, int(self.retention_s) + HOUR_S)

    async def _model(self, model_id: str) -> tuple[str, str, str] | None:
        if model_id not in self._models:
            rec = await self.store.runs.get(model_id)
            if rec is None:
                return None
            self._models[model_id] = (rec.owner, rec.session_id, rec.base_model)
        return self._models[model_id]

    async def on_cycle(
        self, plan: CyclePlan, outcomes: Mapping[str, Outcome], seconds: float, batch: WriteBatch
    ) -> None:
        """After collect (the clock's `observers.AccountingObserver`), queued on the cycle's
        batch: each model's pass tokens and steps, its share of the cycle's wall time (by pass
        tokens; equal shares in a cycle without passes), the checkpoints it saved, and an audit
        entry per new checkpoint."""
        total = plan.tokens
        for work in plan.models:
            who = await self._model(work.model_id)
            if who is None:
                continue
            saved = [
                o.checkpoint
                for op in work.ops()
                if (o := outcomes.get(op.request_id)) is not None and o.checkpoint is not None
            ]
            share = work.tokens / total if total else 1 / len(plan.models)
            self._add(
                batch,
                *who,
                {
                    Counter.TOKENS_TRAINED: sum(
                        op.tokens for op in work.passes if registry.trains(op.kind)
                    ),
                    Counter.STEPS: int(work.optim is not None),
                    Counter.CYCLE_SECONDS: seconds * share,
                    Counter.CHECKPOINTS: len(saved),
                },
            )
            for ckpt in saved:
                self._audit(
                    batch,
                    who[0],
                    AuditEvent.CHECKPOINT_CREATED,
                    tinker_path=ckpt.tinker_path,
                    size_bytes=ckpt.size_bytes,
                    session_id=who[1],
                )

    async def custom_loss_created(
        self, owner: str, session_id: str, base_model: str, loss_id: str, name: str
    ) -> None:
        """A session stored a custom loss (it leaves with the session): counted and audited."""
        async with self.store.batch() as batch:
            self._add(batch, owner, session_id, base_model, {Counter.CUSTOM_LOSSES: 1})
            self._audit(
                batch,
                owner,
                AuditEvent.CUSTOM_LOSS_CREATED,
                session_id=session_id,
                loss_id=loss_id,
                name=name,
            )

    async def on_sampled(
        self,
        jobs: Sequence[Job],
        requests: Sequence[SampleRequest],
        results: Sequence[SampleResult],
        batch: WriteBatch,
    ) -> None:
        """The sampling lane's hook after a batch, queued on the batch that answers it: prompt
        and generated tokens, samples."""
        for job, req, res in zip(jobs, requests, results, strict=True):
            if res.error is not None:
                continue
            self._add(
                batch,
                job.owner,
                *await self._sampler(job.model_id),
                {
                    Counter.TOKENS_PREFILL: len(req.prompt),
                    Counter.TOKENS_SAMPLED: sum(len(s.tokens) for s in res.sequences),
                    Counter.SAMPLES: len(res.sequences),
                },
            )

    async def _sampler(self, sampler_id: str) -> tuple[str, str]:
        if sampler_id not in self._samplers:
            sampler = await self.store.samplers.get(sampler_id)
            if sampler is None:
                return "", ""
            self._samplers[sampler_id] = (sampler.session_id, sampler.base_model)
        return self._samplers[sampler_id]

    async def usage(self, owner: str, start: float, end: float) -> list[pb.UsageBucket]:
        buckets: dict[tuple[int, str, str], pb.UsageBucket] = {}
        hours = range(int(start // HOUR_S), int((end - 1e-9) // HOUR_S) + 1)
        for hour, counters in zip(hours, await self.ledger.usage(owner, hours), strict=True):
            for field, amount in counters.items():
                session, base, counter = field.rsplit("|", 2)
                b = buckets.setdefault(
                    (hour, session, base),
                    pb.UsageBucket(
                        start=hour * HOUR_S, session_id=session, base_model=base, owner=owner
                    ),
                )
                if counter == Counter.CYCLE_SECONDS:
                    b.cycle_seconds += amount
                else:
                    setattr(b, counter, getattr(b, counter) + round(amount))
        return [buckets[k] for k in sorted(buckets)]

    # ---------------------------------------------------------------- audit log
    async def audit(self, owner: str, event: AuditEvent, **details: Any) -> None:
        async with self.store.batch() as batch:
            self._audit(batch, owner, event, **details)

    def _audit(self, batch: WriteBatch, owner: str, event: AuditEvent, **details: Any) -> None:
        """Queue one audit entry on `batch`; entries older than the retention go as it grows."""
        entry = json.dumps({"api_key_owner": owner, **details}, sort_keys=True, default=str)
        batch.audit(owner, str(event), entry, self.retention_s)

    async def audit_log(self, owner: str, start: float, end: float) -> list[pb.AuditEntry]:
        low = max(int(start * 1000), int((time.time() - self.retention_s) * 1000), 0)
        high = max(int(end * 1000) - 1, 0)
        return [
            pb.AuditEntry(time=t, event=event, details_json=details)
            for t, event, details in await self.ledger.audit_entries(owner, low, high)
        ]
