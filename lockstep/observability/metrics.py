"""Prometheus metrics: the registries, the shared buckets, the scheduler's metrics (tenants and
queues, engines and sampling, Redis, RPCs) and the errors of both processes. The clock's are in
`clock_metrics`, the gateway's HTTP metrics in `gateway_metrics`; nothing else defines one.

Each process has its own registry: `SCHEDULER` is served by the scheduler's ops server
(`--metrics-port`: `/metrics`, see `ops_server`), `GATEWAY` by the gateway at `GET /metrics`
(see `asgi`). The scheduler and the gateway call the small helpers below; docs/operations.md
says what each metric means, which alerts to set and how to size the clock cycle.

Label cardinality is bounded by construction: no request, session, sampler or model id is ever a
label. Per-tenant series are labelled `owner` (the API key's owner id, sha256(key)[:16]), and at
most `--metrics-max-tenants` owners (default 32) have series of their own at once; the rest are
counted under owner="other" (`tracking.TenantLabels`). HTTP routes are the route templates
(`/api/v1/training_runs/{run_id}`), never raw paths; an unknown path is route="unmatched".
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Enum,
    Gauge,
    Histogram,
    Info,
    disable_created_metrics,
)
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

from lockstep.observability.tracking import OwnerCache, TenantLabels
from lockstep.version import STATE_FORMAT, VERSION

if TYPE_CHECKING:
    from lockstep.engine.types import SampleResult

log = logging.getLogger(__name__)

disable_created_metrics()  # no `*_created` series: they double the series count for nothing

SCHEDULER = CollectorRegistry()
GATEWAY = CollectorRegistry()
for _registry in (SCHEDULER, GATEWAY):
    ProcessCollector(registry=_registry)
    PlatformCollector(registry=_registry)
    GCCollector(registry=_registry)

for _registry in (SCHEDULER, GATEWAY):
    Info(
        "lockstep_build",
        "The running Lockstep version and the state format it writes.",
        registry=_registry,
    ).info({"version": VERSION, "state_format": str(STATE_FORMAT)})

# Buckets. Cycles run from milliseconds (tiny model, CPU) to minutes (big packed batches).
CYCLE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# Long polls (retrieve_future) hold a call up to 25 s, the SDK gives up at 45 s.
HTTP_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    20,
    30,
    45,
    60,
)
RATIO_BUCKETS = (0.01, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0, 1.5, 2)
TENANT_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128, 256)
REDIS_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
)
PUBLISH_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)

# ---------------------------------------------------------------- scheduler: tenants and queues
TENANT_REQUESTS = Counter(
    "lockstep_tenant_requests_total",
    "Requests executed, per owner (capped; see docs/operations.md), kind and outcome.",
    ["owner", "kind", "outcome"],
    registry=SCHEDULER,
)
TENANT_TOKENS = Counter(
    "lockstep_tenant_tokens_total",
    "Tokens processed per owner: pass tokens (forward, forward_backward), generated tokens "
    "(sample).",
    ["owner", "kind"],
    registry=SCHEDULER,
)
QUEUE_DEPTH = Gauge(
    "lockstep_queue_depth",
    "Training requests queued per owner (ready or waiting on a gap).",
    ["owner"],
    registry=SCHEDULER,
)
FUTURES_PENDING = Gauge(
    "lockstep_futures_pending",
    "Submitted requests whose result is not written yet.",
    ["kind"],
    registry=SCHEDULER,
)
FUTURE_WAITERS = Gauge(
    "lockstep_future_waiters",
    "retrieve_future long polls the scheduler is holding now.",
    registry=SCHEDULER,
)
SUBMISSIONS = Counter(
    "lockstep_submissions_total",
    "Requests accepted and queued (first submission only).",
    ["kind"],
    registry=SCHEDULER,
)
RETRIES_DEDUPLICATED = Counter(
    "lockstep_retries_deduplicated_total",
    "Resubmissions of an already queued (model, seq_id) or (sampler, seq_id): answered with "
    "the first request id, not run again.",
    ["kind"],
    registry=SCHEDULER,
)

# ---------------------------------------------------------------- scheduler: engines, Redis
ENGINE_PHASE = Enum(
    "lockstep_engine_phase",
    "What each engine process is doing now (train: passes and optimizer steps; checkpoint: "
    "create/save/load; sample; publish: loading new adapter weights into the sampler).",
    ["engine"],
    states=["idle", "train", "checkpoint", "sample", "publish"],
    registry=SCHEDULER,
)
ENGINE_BUSY_SECONDS = Counter(
    "lockstep_engine_busy_seconds_total",
    "Time each engine spent in each phase.",
    ["engine", "phase"],
    registry=SCHEDULER,
)
SAMPLER_MEMORY_TRANSITIONS = Counter(
    "lockstep_sampler_memory_transitions_total",
    "Colocated mode (--colocate): the sampler releasing its accelerator memory before a "
    "training phase (release) and taking it back after (resume).",
    ["action"],
    registry=SCHEDULER,
)
ADAPTER_PUBLISH_SECONDS = Histogram(
    "lockstep_adapter_publish_duration_seconds",
    "Time to load new sampler weights (a LoRA adapter) into the sampling engine.",
    buckets=PUBLISH_BUCKETS,
    registry=SCHEDULER,
)
TRAINER_PATH = Gauge(
    "lockstep_trainer_path",
    "1 on the path the training engine runs the base model on: packed, or generic (a family "
    "outside the packed list: each row alone through the model's own forward, exact but slower).",
    ["path"],
    registry=SCHEDULER,
)
HYBRID_KERNEL = Gauge(
    "lockstep_hybrid_kernel",
    "1 on the implementation each hybrid kernel of the base model (gated_delta_rule, "
    "short_convolution, mamba2_scan) runs in each engine: a field kernel (fla, causal-conv1d, "
    "mamba-ssm) or reference (PyTorch: exact, much slower on a GPU; the load log says why).",
    ["engine", "kernel", "implementation"],
    registry=SCHEDULER,
)
RESIDENT_MODELS = Gauge(
    "lockstep_resident_models",
    "Training runs whose adapter and Adam state the training engine holds right now.",
    registry=SCHEDULER,
)
MODEL_PAGES = Counter(
    "lockstep_model_pages_total",
    "Training runs moved out of the engine (out: paged for room, freed: session over or "
    "unloaded) and back in (in: restored from snapshot + replay log).",
    ["direction"],
    registry=SCHEDULER,
)
PAGE_IN_SECONDS = Histogram(
    "lockstep_model_page_in_duration_seconds",
    "Time to restore a training run into the engine (snapshot load + replayed passes).",
    buckets=PUBLISH_BUCKETS,
    registry=SCHEDULER,
)
SAMPLER_TOKENS = Counter(
    "lockstep_sampler_tokens_total", "Tokens generated by the sampling engine.", registry=SCHEDULER
)
SAMPLER_BATCH_SECONDS = Histogram(
    "lockstep_sampler_batch_duration_seconds",
    "Wall time of one sampling engine batch.",
    buckets=CYCLE_BUCKETS,
    registry=SCHEDULER,
)
SAMPLER_BATCH_REQUESTS = Histogram(
    "lockstep_sampler_batch_requests",
    "Sample requests (all tenants) in one engine batch.",
    buckets=BATCH_BUCKETS,
    registry=SCHEDULER,
)
REDIS_RTT_SECONDS = Histogram(
    "lockstep_redis_rtt_seconds",
    "Round-trip time of a Redis PING from the scheduler.",
    buckets=REDIS_BUCKETS,
    registry=SCHEDULER,
)
REDIS_USED_MEMORY = Gauge(
    "lockstep_redis_used_memory_bytes",
    "Memory Redis uses (its INFO used_memory), read every second by the scheduler.",
    registry=SCHEDULER,
)
REDIS_MAX_MEMORY = Gauge(
    "lockstep_redis_max_memory_bytes",
    "Redis's memory limit (maxmemory; 0: none). Past 90 % of it the scheduler refuses new work "
    "(HTTP 429, retried by the SDK) until results expire or the limit is raised.",
    registry=SCHEDULER,
)
ADMISSION_PAUSED = Gauge(
    "lockstep_admission_paused",
    "1 while the scheduler refuses new work for lack of room (reason: redis_memory).",
    ["reason"],
    registry=SCHEDULER,
)
REDIS_ROUND_TRIPS = Counter(
    "lockstep_redis_round_trips_total",
    "Exchanges with Redis (one command, or one pipeline or transaction sent at once) by what "
    "made them: rpc:<gRPC method>, clock_plan / clock_dispatch / clock_collect (a cycle's "
    "steps; clock_after: its bookkeeping after the futures are answered), sampling, other.",
    ["caller"],
    registry=SCHEDULER,
)
REDIS_ROUND_TRIP_SECONDS = Counter(
    "lockstep_redis_round_trip_seconds_total",
    "Time from sending each of those exchanges to reading its last reply, by caller.",
    ["caller"],
    registry=SCHEDULER,
)
RPC_SECONDS = Histogram(
    "lockstep_rpc_duration_seconds",
    "Time the scheduler spent in each gRPC method's handler (RetrieveFuture: a long poll).",
    ["method"],
    buckets=HTTP_BUCKETS,
    registry=SCHEDULER,
)


class RedisCaller(StrEnum):
    """What made a Redis round trip (the `caller` label), besides "rpc:<gRPC method>"."""

    CLOCK_PLAN = "clock_plan"  # read the queues and plan
    CLOCK_DISPATCH = "clock_dispatch"  # restore, page, the engine's phases
    CLOCK_COLLECT = "clock_collect"  # record outcomes, wake the futures
    CLOCK_AFTER = "clock_after"  # after the futures are answered: trace, usage, durability
    SAMPLING = "sampling"  # the sampling lane
    OTHER = "other"  # probes, expiry scans, start-up


# What is talking to Redis in the running task: set where a task's role is known (the gRPC
# handlers, the clock's steps, the sampling lane); tasks it starts inherit it.
REDIS_CALLER: ContextVar[str] = ContextVar("lockstep_redis_caller", default=RedisCaller.OTHER)


# ---------------------------------------------------------------- errors (both processes)
ERROR_CATEGORIES = frozenset(
    {
        "user",
        "auth",
        "not_found",
        "capacity",
        "unavailable",
        "server",
        "cycle",
        "engine",
        "sampling",
        "redis",
        "audit",
    }
)
SCHEDULER_ERRORS = Counter(
    "lockstep_errors_total",
    "Errors by component and category (docs/operations.md).",
    ["component", "category"],
    registry=SCHEDULER,
)
GATEWAY_ERRORS = Counter(
    "lockstep_errors_total",
    "Errors by component and category (docs/operations.md).",
    ["component", "category"],
    registry=GATEWAY,
)

TENANTS = TenantLabels()
OWNERS = OwnerCache()


def configure(max_tenants: int) -> None:
    """Set the per-owner label cap (`--metrics-max-tenants`) before any series exists."""
    TENANTS.cap = max_tenants


def scheduler_error(category: str) -> None:
    SCHEDULER_ERRORS.labels(
        "scheduler", category if category in ERROR_CATEGORIES else "server"
    ).inc()


def gateway_error(category: str) -> None:
    GATEWAY_ERRORS.labels("gateway", category if category in ERROR_CATEGORIES else "server").inc()


def tenant_inc(metric: Counter, owner: str | None, *labels: str, amount: float = 1) -> None:
    label = TENANTS.label(owner)
    values = (label, *labels)
    metric.labels(*values).inc(amount)
    TENANTS.track(label, metric, values)


# ---------------------------------------------------------------- submissions
def submitted(owner: str, model_id: str, kind: str, created: bool) -> None:
    """A submission was claimed: a new request, or a deduplicated retry of a queued one."""
    (SUBMISSIONS if created else RETRIES_DEDUPLICATED).labels(kind).inc()
    if kind != "sample":
        OWNERS.note(model_id, owner)


_REFUSALS = {"INVALID_ARGUMENT": "user", "NOT_FOUND": "not_found", "RESOURCE_EXHAUSTED": "capacity"}


def refused(status_code: str) -> None:
    """A scheduler RPC answered with an error status (a gRPC status code name)."""
    scheduler_error(_REFUSALS.get(status_code, "server"))


# ---------------------------------------------------------------- engines and sampling
_PHASES = {
    "run_passes": "train",
    "optim_step": "train",
    "sample": "sample",
    "load_adapter": "publish",
}


@dataclass
class Timer:
    seconds: float = 0.0


@contextmanager
def engine_call(engine: str, verb: str) -> Iterator[Timer]:
    """Mark `engine` busy in the phase of `verb` (an engine method name) while the block runs."""
    phase = _PHASES.get(verb, "checkpoint")
    timer = Timer()
    start = time.monotonic()
    ENGINE_PHASE.labels(engine).state(phase)
    try:
        yield timer
    finally:
        timer.seconds = time.monotonic() - start
        ENGINE_PHASE.labels(engine).state("idle")
        ENGINE_BUSY_SECONDS.labels(engine, phase).inc(timer.seconds)


def sampled(owners: list[str], results: list[SampleResult], seconds: float) -> None:
    """One sampling engine batch finished: `owners[i]` asked for `results[i]`."""
    SAMPLER_BATCH_SECONDS.observe(seconds)
    SAMPLER_BATCH_REQUESTS.observe(len(results))
    for owner, result in zip(owners, results, strict=True):
        ok = result.error is None
        tenant_inc(TENANT_REQUESTS, owner, "sample", "ok" if ok else "failed")
        if not ok:
            scheduler_error("user")
            continue
        tokens = sum(len(seq.tokens) for seq in result.sequences)
        SAMPLER_TOKENS.inc(tokens)
        tenant_inc(TENANT_TOKENS, owner, "sample", amount=tokens)


def sample_failed(owners: Iterable[str]) -> None:
    """Sample requests answered with an error before reaching the engine (e.g. no sampler)."""
    for owner in owners:
        tenant_inc(TENANT_REQUESTS, owner, "sample", "failed")
        scheduler_error("user")


def sample_backlog(queued: int) -> None:
    FUTURES_PENDING.labels("sample").set(queued)


def sampler_memory(action: str) -> None:
    """Colocated mode: the sampler released ("release") or took back ("resume") its memory."""
    SAMPLER_MEMORY_TRANSITIONS.labels(action).inc()


def residency(resident: int, direction: str | None = None, seconds: float | None = None) -> None:
    """The training engine's resident models; a page `direction` ("in", "out", "freed")."""
    RESIDENT_MODELS.set(resident)
    if direction is not None:
        MODEL_PAGES.labels(direction).inc()
    if seconds is not None:
        PAGE_IN_SECONDS.observe(seconds)


def adapter_published(seconds: float) -> None:
    ADAPTER_PUBLISH_SECONDS.observe(seconds)


async def probe_redis(ping: Callable[[], Awaitable[object]], interval_s: float = 5.0) -> None:
    """Measure the Redis round trip every `interval_s` until cancelled."""
    while True:
        start = time.monotonic()
        try:
            await asyncio.wait_for(ping(), timeout=max(interval_s, 1.0))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("redis ping failed: %s", exc)
            scheduler_error("redis")
        else:
            REDIS_RTT_SECONDS.observe(time.monotonic() - start)
        await asyncio.sleep(interval_s)
