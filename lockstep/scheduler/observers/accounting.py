"""Accounting per API key: usage counters by hour and session, and an append-only audit log.

Both live in Redis beside the rest of the state. Usage is a hash per (owner, UTC hour) of
`<session>|<base_model>|<counter>` -> amount, written by the clock (training) and the sampling
lane (samples); a range query reads the hours it covers. The audit log is a Redis stream per
owner (XADD only: entries are never edited), trimmed by age to the retention.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from lockstep.engine.types import SampleRequest, SampleResult
from lockstep.scheduler.ops import registry
from lockstep.scheduler.state import keys
from lockstep.scheduler.state.store import Job, Store
from lockstep.v1 import scheduler_pb2 as pb
from lockstep.vocab import AuditEvent

if TYPE_CHECKING:
    from lockstep.scheduler.planner import CyclePlan
    from lockstep.scheduler.state.outcome import Outcome

HOUR_S = 3600


class Counter(StrEnum):
    TOKENS_TRAINED = "tokens_trained"
    TOKENS_PREFILL = "tokens_prefill"
    TOKENS_SAMPLED = "tokens_sampled"
    STEPS = "steps"
    SAMPLES = "samples"
    CYCLE_SECONDS = "cycle_seconds"
    CHECKPOINTS = "checkpoints"


class Accounting:
    def __init__(self, store: Store, retention_s: float) -> None:
        self.redis = store.redis
        self.store = store
        self.retention_s = retention_s
        # Who a model or sampler belongs to (immutable once created): read once each.
        self._models: dict[str, tuple[str, str, str]] = {}  # model -> owner, session, base
        self._samplers: dict[str, tuple[str, str]] = {}  # sampler -> session, base

    # ---------------------------------------------------------------- usage
    async def add(
        self, owner: str, session_id: str, base_model: str, counts: dict[Counter, float]
    ) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            self._add(pipe, owner, session_id, base_model, counts)
            await pipe.execute()

    def _add(
        self,
        pipe: Any,
        owner: str,
        session_id: str,
        base_model: str,
        counts: dict[Counter, float],
    ) -> None:
        """Queue one usage increment on `pipe` (a caller's batch: one round trip for all)."""
        key = keys.usage(owner, int(time.time() // HOUR_S))
        for counter, amount in counts.items():
            if amount:
                pipe.hincrbyfloat(key, f"{session_id}|{base_model}|{counter}", amount)
        pipe.expire(key, int(self.retention_s) + HOUR_S)

    async def _model(self, model_id: str) -> tuple[str, str, str] | None:
        if model_id not in self._models:
            rec = await self.store.model(model_id)
            if rec is None:
                return None
            self._models[model_id] = (rec.owner, rec.session_id, rec.base_model)
        return self._models[model_id]

    async def on_cycle(
        self, plan: CyclePlan, outcomes: Mapping[str, Outcome], seconds: float
    ) -> None:
        """After collect (the clock's `observers.AccountingObserver`): each model's pass tokens
        and steps, its share of the cycle's wall time (by pass tokens; equal shares in a cycle
        without passes), the checkpoints it saved, and an audit entry per new checkpoint."""
        total = plan.tokens
        async with self.redis.pipeline(transaction=False) as pipe:
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
                    pipe,
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
                        pipe,
                        who[0],
                        AuditEvent.CHECKPOINT_CREATED,
                        tinker_path=ckpt.tinker_path,
                        size_bytes=ckpt.size_bytes,
                        session_id=who[1],
                    )
            await pipe.execute()

    async def on_sampled(
        self,
        jobs: Sequence[Job],
        requests: Sequence[SampleRequest],
        results: Sequence[SampleResult],
    ) -> None:
        """The sampling lane's hook after a batch: prompt and generated tokens, samples."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for job, req, res in zip(jobs, requests, results, strict=True):
                if res.error is not None:
                    continue
                self._add(
                    pipe,
                    job.owner,
                    *await self._sampler(job.model_id),
                    {
                        Counter.TOKENS_PREFILL: len(req.prompt),
                        Counter.TOKENS_SAMPLED: sum(len(s.tokens) for s in res.sequences),
                        Counter.SAMPLES: len(res.sequences),
                    },
                )
            await pipe.execute()

    async def _sampler(self, sampler_id: str) -> tuple[str, str]:
        if sampler_id not in self._samplers:
            sampler = await self.store.sampler(sampler_id)
            if sampler is None:
                return "", ""
            self._samplers[sampler_id] = (sampler.session_id, sampler.base_model)
        return self._samplers[sampler_id]

    async def usage(self, owner: str, start: float, end: float) -> list[pb.UsageBucket]:
        buckets: dict[tuple[int, str, str], pb.UsageBucket] = {}
        for hour in range(int(start // HOUR_S), int((end - 1e-9) // HOUR_S) + 1):
            raw = await self.redis.hgetall(keys.usage(owner, hour))
            for field, value in raw.items():
                session, base, counter = field.decode().rsplit("|", 2)
                b = buckets.setdefault(
                    (hour, session, base),
                    pb.UsageBucket(start=hour * HOUR_S, session_id=session, base_model=base),
                )
                amount = float(value)
                if counter == Counter.CYCLE_SECONDS:
                    b.cycle_seconds += amount
                else:
                    setattr(b, counter, getattr(b, counter) + round(amount))
        return [buckets[k] for k in sorted(buckets)]

    # ---------------------------------------------------------------- audit log
    async def audit(self, owner: str, event: AuditEvent, **details: Any) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            self._audit(pipe, owner, event, **details)
            await pipe.execute()

    def _audit(self, pipe: Any, owner: str, event: AuditEvent, **details: Any) -> None:
        """Queue one audit entry on `pipe`; entries older than the retention go as it grows."""
        entry = json.dumps({"api_key_owner": owner, **details}, sort_keys=True, default=str)
        pipe.xadd(
            keys.audit(owner),
            {"event": str(event), "details": entry},
            minid=str(int((time.time() - self.retention_s) * 1000)),
            approximate=True,
        )

    async def audit_log(self, owner: str, start: float, end: float) -> list[pb.AuditEntry]:
        low = str(max(int(start * 1000), int((time.time() - self.retention_s) * 1000), 0))
        high = str(max(int(end * 1000) - 1, 0))
        out = []
        for entry_id, fields in await self.redis.xrange(keys.audit(owner), low, high):
            out.append(
                pb.AuditEntry(
                    time=int(entry_id.decode().split("-")[0]) / 1000,
                    event=fields[b"event"].decode(),
                    details_json=fields[b"details"].decode(),
                )
            )
        return out
