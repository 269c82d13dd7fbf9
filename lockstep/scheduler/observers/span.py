"""The clock's span object: what one cycle reports to the metrics as it goes.

The clock's `observers.MeterObserver` opens a `CycleSpan` per cycle (`ClockMeter.begin`) and
marks each step; the meter turns the plan, the queues and the outcomes into the series defined
in `observability.metrics`. It lives here, not beside the metric definitions, because it
reads scheduler types (plans, queued ops, outcomes): the metrics module stays a leaf that every
process may import.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from lockstep.observability import clock_metrics, metrics
from lockstep.observability.metrics import RedisCaller
from lockstep.observability.tracking import BusyWindow, HasOwner
from lockstep.scheduler.ops import registry

if TYPE_CHECKING:
    from lockstep.scheduler.planner import CyclePlan
    from lockstep.scheduler.state.outcome import Outcome
    from lockstep.scheduler.state.records import QueuedOp


@dataclass
class CycleSpan:
    """Timestamps of one cycle (time.monotonic)."""

    start: float = field(default_factory=time.monotonic)
    marks: dict[str, float] = field(default_factory=dict)

    def mark(self, phase: str) -> None:
        now = time.monotonic()
        previous = max(self.marks.values(), default=self.start)
        clock_metrics.CYCLE_PHASE_SECONDS.labels(phase).observe(now - previous)
        self.marks[phase] = now


class ClockMeter:
    """What the clock reports about each cycle, called at each step of a cycle (through
    `observers.MeterObserver`)."""

    def __init__(
        self,
        token_budget: int,
        lookup_model: Callable[[str], Awaitable[HasOwner | None]],
        window_s: float = 60.0,
    ) -> None:
        self.lookup_model = lookup_model
        self.busy = BusyWindow(window_s)
        clock_metrics.CLOCK_TOKEN_BUDGET.set(token_budget)
        clock_metrics.CLOCK_BUSY_RATIO.set_function(self.busy.ratio)
        self._queued_owners: set[str] = set()

    def begin(self) -> CycleSpan:
        metrics.REDIS_CALLER.set(RedisCaller.CLOCK_PLAN)  # the clock's task: its steps label
        return CycleSpan()  # its Redis round trips until the next step sets another

    async def planned(
        self,
        span: CycleSpan,
        queues: Mapping[str, list[QueuedOp]],
        plan: CyclePlan,
        runs: bool,
    ) -> None:
        """The queues were read and planned; `runs`: the cycle goes on (work or periodic)."""
        await metrics.OWNERS.resolve(queues, self.lookup_model)
        depth: dict[str, int] = {}
        for model_id, ops in queues.items():
            label = metrics.TENANTS.label(metrics.OWNERS.get(model_id))
            depth[label] = depth.get(label, 0) + len(ops)
        for label in self._queued_owners - depth.keys():
            metrics.QUEUE_DEPTH.labels(label).set(0)
        for label, n in depth.items():
            metrics.QUEUE_DEPTH.labels(label).set(n)
            metrics.TENANTS.track(label, metrics.QUEUE_DEPTH, (label,))
        self._queued_owners = set(depth)
        metrics.FUTURES_PENDING.labels("training").set(sum(depth.values()))
        clock_metrics.TENANTS_WAITING.set(len(plan.deficits))
        clock_metrics.CLOCK_TOKEN_BUDGET.set(plan.pace or plan.budget)
        if runs:
            span.mark("plan")
            if not plan.empty:
                self.busy.begin(span.start)
        metrics.REDIS_CALLER.set(RedisCaller.CLOCK_DISPATCH if runs else RedisCaller.CLOCK_AFTER)

    def dispatched(self, span: CycleSpan) -> None:
        span.mark("dispatch")
        metrics.REDIS_CALLER.set(RedisCaller.CLOCK_COLLECT)  # until tracing.cycle_done

    def finished(self, span: CycleSpan, plan: CyclePlan, outcomes: Mapping[str, Outcome]) -> None:
        span.mark("collect")
        seconds = time.monotonic() - span.start
        clock_metrics.CYCLE_SECONDS.observe(seconds)
        clock_metrics.CYCLES.labels("idle" if plan.empty else "work").inc()
        clock_metrics.CYCLE_TOKENS.inc(plan.tokens)
        clock_metrics.CYCLE_BUDGET.inc(plan.budget)
        if plan.budget > 0:
            clock_metrics.CYCLE_TOKEN_UTILIZATION.observe(plan.tokens / plan.budget)
        if plan.empty:
            return
        clock_metrics.CLOCK_BUSY_SECONDS.inc(self.busy.end())
        clock_metrics.CYCLE_TENANTS.observe(len(plan.models))
        for work in plan.models:
            owner = metrics.OWNERS.get(work.model_id)
            for op in work.ops():
                if op.kind == "rejected":  # refused at submission, counted there
                    continue
                outcome = outcomes.get(op.request_id)
                ok = outcome is not None and outcome.error is None
                outcome_label = "ok" if ok else "failed"
                metrics.tenant_inc(metrics.TENANT_REQUESTS, owner, op.kind, outcome_label)
                if not ok:
                    metrics.scheduler_error(outcome.category if outcome is not None else "server")
                elif registry.is_pass(op.kind):
                    metrics.tenant_inc(metrics.TENANT_TOKENS, owner, op.kind, amount=op.tokens)
            for op in work.passes:  # a part before its request's last: its tokens ran
                if op.request_id == work.open:
                    metrics.tenant_inc(metrics.TENANT_TOKENS, owner, op.kind, amount=op.tokens)

    def failed(self, category: str = "cycle") -> None:
        """The cycle raised ("cycle"; the clock logs it and goes on) or was abandoned because
        the engine died ("engine"; it runs again on a fresh engine)."""
        clock_metrics.CLOCK_BUSY_SECONDS.inc(self.busy.end())
        metrics.scheduler_error(category)
