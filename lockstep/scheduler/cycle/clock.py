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
from collections.abc import Sequence

from lockstep.config import ClockConfig
from lockstep.scheduler.cycle.dispatch import CycleAborted, Dispatcher
from lockstep.scheduler.cycle.pace import CyclePace
from lockstep.scheduler.cycle.partners import Partners
from lockstep.scheduler.cycle.recovery import Recovery
from lockstep.scheduler.cycle.sampling_lane import SamplingLane
from lockstep.scheduler.observers.observers import (
    CycleFailure,
    CycleObserver,
    MeterObserver,
    Observers,
    TraceObserver,
)
from lockstep.scheduler.observers.span import ClockMeter
from lockstep.scheduler.ops import registry
from lockstep.scheduler.planner import CyclePlan, plan_cycle
from lockstep.scheduler.state.futures import FutureBoard
from lockstep.scheduler.state.outcome import NO_OUTCOME, Outcome
from lockstep.scheduler.state.records import QueuedOp
from lockstep.scheduler.state.store import Store
from lockstep.vocab import ClockPolicy, OpKind, QueueState

log = logging.getLogger(__name__)
# An idle clock records the background snapshots that finished meanwhile this often, so a
# model's replay log (and the results it keeps) is trimmed soon after its last step.
IDLE_DURABILITY_S = 1.0


class Clock:
    def __init__(
        self,
        store: Store,
        dispatcher: Dispatcher,
        recovery: Recovery,
        board: FutureBoard,
        lane: SamplingLane,
        config: ClockConfig,
        key_token_cap: int = 0,
        observers: Sequence[CycleObserver] = (),
    ) -> None:
        self.store = store
        self.dispatcher = dispatcher  # runs a cycle's plan on the engine
        self.recovery = recovery  # snapshots, restore and the resident set, between cycles
        self.board = board
        self.lane = lane
        self.config = config
        # Limits.max_tokens_per_cycle_per_key: a per-key quota, so it is configured with the
        # other quotas (Limits), not with how cycles are started (ClockConfig).
        self.key_token_cap = key_token_cap
        self.wake = asyncio.Event()
        self.cycles_run = 0
        self.deficits: dict[str, int] = {}  # fairness: pass tokens each waiting model is owed
        # Who watches each cycle (observers.py): traces, the caller's (accounting), then the
        # metrics last, so the cycle time they report covers the other observers' writes.
        meter = MeterObserver(ClockMeter(config.token_budget, store.runs.get))
        self.observers = Observers([TraceObserver(), *observers, meter])
        # Pass tokens per cycle: what the engine does in --cycle-target seconds (pace.py).
        self.pace = CyclePace(config.token_budget, config.cycle_target_s)
        # Models that shared the last cycle: a cycle waits a little for one not queued yet.
        self.partners = Partners()
        self._stopping = False
        self._stopped = asyncio.Event()
        self._backlog = False  # passes had to wait for room: the next cycle starts at once

    def queue_state(self, model_id: str) -> tuple[QueueState, str]:
        """What a waiting request of `model_id` is told (TryAgain.queue_state and reason)."""
        if model_id in self.deficits:
            return (
                QueueState.PAUSED_CAPACITY,
                "waiting for room in a clock cycle (token budget shared "
                "fairly between tenants, or this API key's tokens-per-cycle quota)",
            )
        return QueueState.ACTIVE, ""

    def stop(self) -> None:
        self._stopping = True
        self._stopped.set()
        self.wake.set()

    async def _pause(self, seconds: float) -> None:
        """Sleep `seconds`, or less if the clock is stopped meanwhile (a long --clock-gather
        or --clock-period never holds up a shutdown; the work waiting stays queued)."""
        try:
            await asyncio.wait_for(self._stopped.wait(), timeout=seconds)
        except TimeoutError:
            pass

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
                await self.observers.failed(CycleFailure.CYCLE)
                await self._pause(0.5)
                self.wake.set()  # what it left queued runs again
        log.info("clock stopped after %d cycles", self.cycles_run)

    async def cycle(self) -> CyclePlan:
        """One clock cycle: plan -> dispatch -> publish -> commit -> notify."""
        await self.observers.begun()
        plan, queues = await self.plan()
        runs = not plan.empty or ClockPolicy(self.config.policy) != ClockPolicy.TRIGGERED
        await self.observers.planned(queues, plan, runs)
        if not runs:
            return plan
        started = time.monotonic()
        cycle = await self.dispatcher.begin(plan)  # its number; payloads not held (one trip)
        await self.observers.dispatching(cycle, plan)
        try:
            # The one place training runs: in colocated mode the sampler gives its memory
            # back for the duration (lane.training_phase; a no-op otherwise).
            async with self.lane.training_phase():
                dispatch_started = time.monotonic()
                outcomes = await self.dispatcher.run(plan, cycle)
                self.pace.observe(plan.tokens, time.monotonic() - dispatch_started)
        except CycleAborted:
            await self.observers.failed(CycleFailure.ENGINE)
            self.wake.set()  # nothing was recorded: the same work runs on the fresh engine
            return plan
        plan = plan.settled(outcomes)  # a request whose open part failed is committed now
        await self.observers.dispatched(plan, outcomes)
        # Publish first: the sampler loads new adapters while commit answers the futures and
        # the client asks for its sampling session, instead of after (a task; never blocks).
        self.publish(outcomes)
        try:
            committed = await self.commit(plan, outcomes)
        except Exception:
            # Redis refused it (full, or away past the retries): what was not recorded runs
            # again, on each model restored from its recorded state (the engine is ahead).
            self.dispatcher.forget(plan)
            raise
        self.notify(committed)
        self.partners.after(plan, time.monotonic() - started)
        self.cycles_run += 1
        async with self.store.batch() as batch:  # traces and usage: one round trip
            await self.observers.recording(plan, outcomes, batch)
        await self.observers.finished(plan, outcomes)  # metrics
        await self.recovery.prune(plan, outcomes)  # old snapshot files, once the new ones count
        await self.recovery.record_durable()  # snapshots the engine finished in the background
        if not plan.empty and _left_queued(queues, plan):
            self.wake.set()  # ready now that this cycle advanced the queues (else: a submission)
        return plan

    async def plan(self) -> tuple[CyclePlan, dict[str, list[QueuedOp]]]:
        """Read the queues and plan the cycle (pure `plan_cycle`); keeps the fairness debts."""
        queues, next_seq = await self.store.cycles.queued_ops()
        if ClockPolicy(self.config.policy) == ClockPolicy.TRIGGERED:
            queues, next_seq = await self._wait_for_partners(queues, next_seq)
        ready = self.recovery.resident.admit(queues, next_seq)  # paging: what fits the engine
        owners = await self.store.runs.owners(list(ready)) if self.key_token_cap else None
        pace = self.pace.budget(
            m for m, ops in queues.items() if any(registry.is_pass(op.kind) for op in ops)
        )
        shared = pace if pace < self.config.token_budget else None  # a model alone never splits
        plan = plan_cycle(
            ready,
            next_seq,
            self.config.token_budget,
            self.deficits,
            owners=owners,
            key_cap=self.key_token_cap,
            cycle_tokens=pace,
            datums=await self.dispatcher.datums(queues, next_seq, shared),
        )
        self.deficits = plan.deficits  # the models that had to wait for room in this cycle
        self._backlog = bool(plan.deficits)
        # Models of ended sessions leave the engine once their queues drain (durable state stays).
        await self.recovery.resident.free_ended(w.model_id for w in plan.models)
        return plan, queues

    async def _wait_for_partners(
        self, queues: dict[str, list[QueuedOp]], next_seq: dict[str, int]
    ) -> tuple[dict[str, list[QueuedOp]], dict[str, int]]:
        """Wait (at most about a cycle, `partners.py`) for last cycle's partners that have
        nothing queued yet while the others have; the queues as they are then."""
        missing = self.partners.missing(queues)
        deadline = time.monotonic() + self.partners.wait_s()
        while missing and not self._stopping and (left := deadline - time.monotonic()) > 0:
            try:
                await asyncio.wait_for(self.wake.wait(), timeout=left)
            except TimeoutError:
                break
            # Cleared before the read, never after it: a submission that lands after the read
            # leaves the wake-up set, so the next tick plans it (cleared after the read, its
            # request would sit queued behind an idle clock).
            self.wake.clear()
            queues, next_seq = await self.store.cycles.queued_ops()
            missing = self.partners.missing(queues)
        self.partners.gone(missing)
        return queues, next_seq

    async def commit(
        self, plan: CyclePlan, outcomes: dict[str, Outcome]
    ) -> list[tuple[QueuedOp, Outcome | None]]:
        """Record every op's outcome, each atomically, all in one round trip; a model's ops in
        seq_id order. Returns each op with the outcome recorded now (None: recorded before, or
        at submission)."""
        pairs = [
            (op, outcomes.get(op.request_id, NO_OUTCOME)) for w in plan.models for op in w.ops()
        ]
        recorded = await self.store.cycles.commit(pairs)
        return [
            (op, o if now and op.kind != OpKind.REJECTED else None)
            for (op, o), now in zip(pairs, recorded, strict=True)
        ]

    def notify(self, committed: list[tuple[QueuedOp, Outcome | None]]) -> None:
        """Wake the futures waiting on this cycle's requests, with the outcome just recorded
        (they need not read it back)."""
        for op, outcome in committed:
            self.board.notify(op.request_id, value=None if outcome is None else outcome.recorded())

    async def _tick(self) -> None:
        if ClockPolicy(self.config.policy) == ClockPolicy.PERIODIC:
            now = time.monotonic()
            await self._pause(self.config.period_s - now % self.config.period_s)
            return
        while not self.wake.is_set():
            try:
                await asyncio.wait_for(self.wake.wait(), timeout=IDLE_DURABILITY_S)
            except TimeoutError:  # idle: record the snapshots the engine finished meanwhile
                await self._record_durable()
        self.wake.clear()
        if not self._backlog:  # work already waiting needs no gathering
            await self._pause(self.config.gather_s)  # requests sent together land together

    async def _record_durable(self) -> None:
        try:
            await self.recovery.record_durable()
        except Exception:  # the next cycle records them; never stop the clock for this
            log.exception("recording durable snapshots failed")

    def publish(self, outcomes: dict[str, Outcome]) -> None:
        """Every adapter this cycle saved for sampling, published in one batch."""
        self.lane.publish(
            [
                (o.sampler.adapter_id or "", o.adapter_dir)
                for o in outcomes.values()
                if o.sampler is not None and o.adapter_dir is not None and o.inflight is None
            ],
            [o.inflight for o in outcomes.values() if o.inflight is not None],
        )


def _left_queued(queues: dict[str, list[QueuedOp]], plan: CyclePlan) -> bool:
    """Whether the plan left queued requests behind (the next cycle may run them now). When it
    took them all, only a new submission brings work, and it wakes the clock itself."""
    return sum(map(len, queues.values())) > sum(len(w.ops()) for w in plan.models)
