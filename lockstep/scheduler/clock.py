"""The clock: lock-step cycles over the training work of every tenant.

    plan     -> which queued requests of which models run in this cycle (pure, `planner`)
    dispatch -> one fused pass + one batched optimizer step on the engine (`dispatch`)
    collect  -> write each request's result to Redis and wake its future
    publish  -> hand new sampler weights to the sampling lane (off the critical path; started
                just before collect so the load overlaps the client's round trips)
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Literal

from lockstep.observability import metrics
from lockstep.scheduler.dispatch import CycleAborted, Dispatcher, Outcome
from lockstep.scheduler.futures import FutureBoard
from lockstep.scheduler.planner import CyclePlan, plan_cycle
from lockstep.scheduler.sampling_lane import SamplingLane
from lockstep.scheduler.store import Store

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClockConfig:
    """How cycles are started.

    policy "triggered": a cycle starts `gather_s` after work arrives and runs everything ready.
    policy "periodic":  a cycle starts every `period_s` whether or not there is work (the
                        counter advances on idle cycles too, as hosted Tinker's does).
    """

    policy: Literal["triggered", "periodic"] = "triggered"
    period_s: float = 1.0
    gather_s: float = 0.02
    token_budget: int = 65536


class Clock:
    def __init__(
        self,
        store: Store,
        dispatcher: Dispatcher,
        board: FutureBoard,
        lane: SamplingLane,
        config: ClockConfig,
        key_token_cap: int = 0,
    ) -> None:
        self.store = store
        self.dispatcher = dispatcher
        self.board = board
        self.lane = lane
        self.config = config
        # Limits.max_tokens_per_cycle_per_key: a per-key quota, so it is configured with the
        # other quotas (Limits), not with how cycles are started (ClockConfig).
        self.key_token_cap = key_token_cap
        self.wake = asyncio.Event()
        self.cycles_run = 0
        self.deficits: dict[str, int] = {}  # fairness: pass tokens each waiting model is owed
        self.meter = metrics.ClockMeter(config.token_budget, store.model)
        self._stopping = False

    def queue_state(self, model_id: str) -> tuple[str, str]:
        """What a waiting request of `model_id` is told (TryAgain.queue_state and reason)."""
        if model_id in self.deficits:
            return "paused_capacity", "waiting for room in a clock cycle (token budget shared " \
                "fairly between tenants, or this API key's tokens-per-cycle quota)"
        return "active", ""

    def stop(self) -> None:
        self._stopping = True
        self.wake.set()

    async def run(self) -> None:
        log.info("clock started (%s)", self.config)
        while not self._stopping:
            await self._tick()
            if self._stopping:
                break
            try:
                await self.cycle()
            except Exception:  # a broken cycle must not stop the clock
                log.exception("clock cycle failed")
                self.meter.failed()
                await asyncio.sleep(0.5)
        log.info("clock stopped after %d cycles", self.cycles_run)

    async def cycle(self) -> CyclePlan:
        span = self.meter.begin()
        queues, next_seq = await self.store.queued_ops()
        owners = await self.store.owners(list(queues)) if self.key_token_cap else None
        plan = plan_cycle(queues, next_seq, self.config.token_budget, self.deficits,
                          owners=owners, key_cap=self.key_token_cap)
        self.deficits = plan.deficits  # the models that had to wait for room in this cycle
        runs = not plan.empty or self.config.policy != "triggered"
        await self.meter.planned(span, queues, plan, runs)
        if not runs:
            return plan
        cycle = await self.store.next_cycle()
        try:
            # The one place training runs: in colocated mode the sampler gives its memory
            # back for the duration (lane.training_phase; a no-op otherwise).
            async with self.lane.training_phase():
                outcomes = await self.dispatcher.run(plan, cycle)
        except CycleAborted:
            self.meter.failed("engine")
            self.wake.set()  # nothing was recorded: the same work runs on the fresh engine
            return plan
        self.meter.dispatched(span)
        # Publish first: the sampler loads new adapters while collect answers the futures and
        # the client asks for its sampling session, instead of after (a task; never blocks).
        self.publish(outcomes)
        await self.collect(plan, outcomes)
        self.cycles_run += 1
        self.meter.finished(span, plan, outcomes)
        if not plan.empty:
            self.wake.set()  # more may be ready now that this cycle advanced the queues
            log.debug("cycle %d: %d models, %d passes, %d steps, %d tokens", cycle,
                      len(plan.models), len(plan.passes), len(plan.optims), plan.tokens)
        return plan

    async def _tick(self) -> None:
        if self.config.policy == "periodic":
            now = time.monotonic()
            await asyncio.sleep(self.config.period_s - now % self.config.period_s)
            return
        await self.wake.wait()
        self.wake.clear()
        await asyncio.sleep(self.config.gather_s)  # let requests sent together land together

    async def collect(self, plan: CyclePlan, outcomes: dict[str, Outcome]) -> None:
        for work in plan.models:
            for op in work.ops():
                if op.kind == "rejected":  # its error was written at submission
                    await self.store.finish_job(op, error=None, keep_status=True)
                    continue
                outcome = outcomes.get(op.request_id) or Outcome(
                    error="internal error: the request produced no outcome", category="server")
                if outcome.checkpoint is not None:
                    await self.store.put_checkpoint(op.model_id, outcome.checkpoint)
                    await self._note_checkpoint(op.model_id, outcome)
                if outcome.sampler is not None:
                    await self.store.put_sampler(outcome.sampler)
                await self.store.finish_job(
                    op,
                    result=outcome.result.SerializeToString() if outcome.result else None,
                    error=outcome.error,
                    category=outcome.category,
                    snapshot_seq=outcome.snapshot_seq,
                )
                if outcome.snapshot_seq is not None:
                    self.dispatcher.prune_snapshots(op.model_id, outcome.snapshot_seq)
                self.board.notify(op.request_id)

    async def _note_checkpoint(self, model_id: str, outcome: Outcome) -> None:
        model = await self.store.model(model_id)
        if model is None or outcome.checkpoint is None:
            return
        if outcome.checkpoint.checkpoint_type == "training":
            model.last_checkpoint = outcome.checkpoint.checkpoint_id
        elif outcome.checkpoint.checkpoint_type == "sampler":
            model.last_sampler_checkpoint = outcome.checkpoint.checkpoint_id
        await self.store.put_model(model)

    def publish(self, outcomes: dict[str, Outcome]) -> None:
        """Every adapter this cycle saved for sampling, published in one batch."""
        self.lane.publish([(o.sampler.adapter_id or "", o.adapter_dir)
                           for o in outcomes.values()
                           if o.sampler is not None and o.adapter_dir is not None])
