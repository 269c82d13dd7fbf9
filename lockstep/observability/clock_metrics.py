"""The clock's metrics (the scheduler's registry): cycle times and phases, tokens per cycle
against the budget, busy time, tenants per cycle and waiting. `scheduler/observers/span.py`
reports them; docs/operations.md says what each means."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from lockstep.observability.metrics import (
    CYCLE_BUCKETS,
    RATIO_BUCKETS,
    SCHEDULER,
    TENANT_BUCKETS,
)

CYCLE_SECONDS = Histogram(
    "lockstep_cycle_duration_seconds",
    "Wall time of one clock cycle: plan, dispatch (fused pass + batched step), collect.",
    buckets=CYCLE_BUCKETS,
    registry=SCHEDULER,
)
CYCLE_PHASE_SECONDS = Histogram(
    "lockstep_cycle_phase_duration_seconds",
    "Wall time of each part of a clock cycle (plan: read the queues from Redis and plan; "
    "dispatch: the engine work; collect: write results and wake futures).",
    ["phase"],
    buckets=CYCLE_BUCKETS,
    registry=SCHEDULER,
)
CYCLES = Counter(
    "lockstep_cycles_total",
    "Clock cycles run; kind=idle are periodic-policy cycles that found nothing to do.",
    ["kind"],
    registry=SCHEDULER,
)
CYCLE_TOKENS = Counter(
    "lockstep_cycle_tokens_total", "Pass tokens packed into clock cycles.", registry=SCHEDULER
)
CYCLE_BUDGET = Counter(
    "lockstep_cycle_token_budget_total",
    "Token budget offered by the clock cycles run (token budget x cycles).",
    registry=SCHEDULER,
)
CYCLE_TOKEN_UTILIZATION = Histogram(
    "lockstep_cycle_token_utilization_ratio",
    "Per cycle: pass tokens packed / token budget (above 1 only when one request larger than "
    "the whole budget runs alone).",
    buckets=RATIO_BUCKETS,
    registry=SCHEDULER,
)
CYCLE_TENANTS = Histogram(
    "lockstep_cycle_tenants",
    "Per cycle with work: distinct training runs (LoRA adapters) that ran in it.",
    buckets=TENANT_BUCKETS,
    registry=SCHEDULER,
)
CLOCK_BUSY_SECONDS = Counter(
    "lockstep_clock_busy_seconds_total",
    "Time spent inside clock cycles that had work; rate() of it is busy time / wall time.",
    registry=SCHEDULER,
)
CLOCK_BUSY_RATIO = Gauge(
    "lockstep_clock_busy_ratio",
    "Busy time / wall time of the clock over the last 60 s (a running cycle counts).",
    registry=SCHEDULER,
)
CLOCK_TOKEN_BUDGET = Gauge(
    "lockstep_clock_token_budget",
    "Pass tokens one model may pack into a cycle now: while tenants share the clock, what the "
    "engine does in --cycle-target seconds at its measured rate (or the next-largest model's "
    "ready passes), at most --token-budget; alone, --token-budget.",
    registry=SCHEDULER,
)
TENANTS_WAITING = Gauge(
    "lockstep_tenants_waiting",
    "Training runs with passes that did not fit the last cycle (their futures answer "
    "queue_state=paused_capacity).",
    registry=SCHEDULER,
)
