"""What watches a clock cycle: one interface, `CycleObserver`, and the observers the clock has.

The clock calls each hook once per phase, on every observer in order; an observer does its own
bookkeeping and never changes the cycle. The scheduler's observers:

- `MeterObserver`: the Prometheus series (`span.ClockMeter`: phase times, queue depths, tokens,
  per-tenant requests, busy time, errors);
- `TraceObserver`: the session traces (`tracing`: the cycle's span and the phases dispatch
  marks inside it);
- `AccountingObserver`: usage per API key and the audit log (`accounting.Accounting`).

Phases, in order: `begun` -> `planned` (an idle triggered clock stops here) -> `dispatching`
-> `dispatched` -> `recording` (every op committed, its future woken: each observer queues its
writes on the cycle's one `WriteBatch`, sent in one round trip) -> `finished`; or `failed`
instead, from wherever the cycle stopped.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from enum import StrEnum
from typing import Protocol

from lockstep.scheduler.observers import tracing
from lockstep.scheduler.observers.accounting import Accounting
from lockstep.scheduler.observers.span import ClockMeter, CycleSpan
from lockstep.scheduler.planner import CyclePlan
from lockstep.scheduler.state.batch import WriteBatch
from lockstep.scheduler.state.outcome import Outcome
from lockstep.scheduler.state.records import QueuedOp


class CycleFailure(StrEnum):
    """How a cycle ended early (also its `lockstep_errors_total` category)."""

    CYCLE = "cycle"  # the cycle raised; the clock logs it and goes on
    ENGINE = "engine"  # the engine died: nothing was recorded, the work runs again


class CycleObserver(Protocol):
    """The clock's phase callbacks. Each does nothing here: an observer subclasses this and
    overrides the hooks it needs."""

    async def begun(self) -> None:
        """A cycle starts: nothing read yet."""
        return None

    async def planned(
        self, queues: Mapping[str, list[QueuedOp]], plan: CyclePlan, runs: bool
    ) -> None:
        """The queues were read and planned; `runs`: the cycle goes on (work, or periodic)."""
        return None

    async def dispatching(self, cycle: int, plan: CyclePlan) -> None:
        """The cycle has its number and goes to the engine."""
        return None

    async def dispatched(self, plan: CyclePlan, outcomes: Mapping[str, Outcome]) -> None:
        """The engine ran it; nothing is recorded yet."""
        return None

    async def recording(
        self, plan: CyclePlan, outcomes: Mapping[str, Outcome], batch: WriteBatch
    ) -> None:
        """Every op's outcome is committed and its future woken: queue this observer's writes
        on `batch` (the clock sends the batch, one round trip, before `finished`)."""
        return None

    async def finished(self, plan: CyclePlan, outcomes: Mapping[str, Outcome]) -> None:
        """The cycle's writes are sent."""
        return None

    async def failed(self, why: CycleFailure) -> None:
        """The cycle ended early (see `CycleFailure`)."""
        return None


class Observers(CycleObserver):
    """Every observer of the clock, each hook called on each in turn."""

    def __init__(self, observers: Iterable[CycleObserver]) -> None:
        self.all = list(observers)

    async def begun(self) -> None:
        for o in self.all:
            await o.begun()

    async def planned(
        self, queues: Mapping[str, list[QueuedOp]], plan: CyclePlan, runs: bool
    ) -> None:
        for o in self.all:
            await o.planned(queues, plan, runs)

    async def dispatching(self, cycle: int, plan: CyclePlan) -> None:
        for o in self.all:
            await o.dispatching(cycle, plan)

    async def dispatched(self, plan: CyclePlan, outcomes: Mapping[str, Outcome]) -> None:
        for o in self.all:
            await o.dispatched(plan, outcomes)

    async def recording(
        self, plan: CyclePlan, outcomes: Mapping[str, Outcome], batch: WriteBatch
    ) -> None:
        for o in self.all:
            await o.recording(plan, outcomes, batch)

    async def finished(self, plan: CyclePlan, outcomes: Mapping[str, Outcome]) -> None:
        for o in self.all:
            await o.finished(plan, outcomes)

    async def failed(self, why: CycleFailure) -> None:
        for o in self.all:
            await o.failed(why)


class MeterObserver(CycleObserver):
    """The cycle's metrics: `ClockMeter` with the span of the cycle running now."""

    def __init__(self, meter: ClockMeter) -> None:
        self.meter = meter
        self._span = CycleSpan()

    async def begun(self) -> None:
        self._span = self.meter.begin()

    async def planned(
        self, queues: Mapping[str, list[QueuedOp]], plan: CyclePlan, runs: bool
    ) -> None:
        await self.meter.planned(self._span, queues, plan, runs)

    async def dispatched(self, plan: CyclePlan, outcomes: Mapping[str, Outcome]) -> None:
        self.meter.dispatched(self._span)

    async def finished(self, plan: CyclePlan, outcomes: Mapping[str, Outcome]) -> None:
        self.meter.finished(self._span, plan, outcomes)

    async def failed(self, why: CycleFailure) -> None:
        self.meter.failed(why)


class TraceObserver(CycleObserver):
    """The cycle in each session's trace: opened before dispatch (which marks its phases inside
    it, `tracing.phase`), queued on the cycle's batch once the futures are answered."""

    def __init__(self) -> None:
        self._trace: tracing.CycleTrace | None = None
        self._planned = time.time()

    async def begun(self) -> None:
        self._planned = time.time()  # before the queues are read

    async def dispatching(self, cycle: int, plan: CyclePlan) -> None:
        ops = [op for work in plan.models for op in work.runs()]
        tenants, tokens = len(plan.models), plan.tokens
        self._trace = tracing.begin_cycle(cycle, ops, tenants, tokens, self._planned)

    async def recording(
        self, plan: CyclePlan, outcomes: Mapping[str, Outcome], batch: WriteBatch
    ) -> None:
        if self._trace is not None:
            trace, self._trace = self._trace, None
            tracing.cycle_done(trace, batch)


class AccountingObserver(CycleObserver):
    """Usage per key: each model's tokens, steps, checkpoints and share of the cycle's time."""

    def __init__(self, accounting: Accounting) -> None:
        self.accounting = accounting
        self._started = time.monotonic()

    async def begun(self) -> None:
        self._started = time.monotonic()

    async def recording(
        self, plan: CyclePlan, outcomes: Mapping[str, Outcome], batch: WriteBatch
    ) -> None:
        await self.accounting.on_cycle(plan, outcomes, time.monotonic() - self._started, batch)
