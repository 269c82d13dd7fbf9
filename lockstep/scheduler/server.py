"""The scheduler process: Redis state, the clock, the gRPC server, around the engines its caller
builds (`python -m lockstep.scheduler` passes `lockstep.backends.start_engines`)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import contextvars
import logging
import signal
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import grpc

from lockstep import config, grpc_options, runtime
from lockstep.config import (
    ClockConfig,
    EngineConfig,
    Limits,
    LockstepConfig,
    SamplerConfig,
    TenancyConfig,
)
from lockstep.engine import memory
from lockstep.engine.capabilities import Engines
from lockstep.engine.interface import SamplingEngine, TrainingEngine
from lockstep.observability import metrics
from lockstep.observability.ops_server import start_ops_server
from lockstep.scheduler.admission.decoded import DecodedPasses
from lockstep.scheduler.admission.submissions import Submissions
from lockstep.scheduler.api import tenancy as tenancy_mod
from lockstep.scheduler.api.catalog_rpcs import CatalogRpcs
from lockstep.scheduler.api.future_rpcs import FutureRpcs
from lockstep.scheduler.api.servicer import servicer
from lockstep.scheduler.api.tenancy_rpcs import TenancyRpcs
from lockstep.scheduler.cycle.clock import Clock
from lockstep.scheduler.cycle.dispatch import Dispatcher
from lockstep.scheduler.cycle.recovery import Recovery
from lockstep.scheduler.cycle.sampling_lane import SamplingLane
from lockstep.scheduler.observers import tracing
from lockstep.scheduler.observers.accounting import Accounting
from lockstep.scheduler.observers.observers import AccountingObserver
from lockstep.scheduler.state.catalog import Catalog
from lockstep.scheduler.state.format import STATE_REFUSED_EXIT, StateRefused, redis_label
from lockstep.scheduler.state.futures import FutureBoard
from lockstep.scheduler.state.memory import EvictingRedis
from lockstep.scheduler.state.store import Store
from lockstep.v1 import scheduler_pb2_grpc as pb_grpc

log = logging.getLogger("lockstep.scheduler")


@dataclass(frozen=True)
class SchedulerConfig:
    """What the scheduler process runs with: its view of the root config, resolved
    (`from_config`)."""

    listen: str  # gRPC address, e.g. "127.0.0.1:50051" or "unix:/path/sock"
    redis_url: str
    data_dir: Path
    model_dir: Path
    served_names: tuple[str, ...]
    image_dir: Path | None = None  # the one directory image_asset_pointer chunks may name
    clock: ClockConfig = field(default_factory=ClockConfig)
    max_sample_batch: int = 64
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None  # /metrics, /healthz, /livez; None: not served; 0: any port
    metrics_max_tenants: int = 32  # owners with per-tenant series of their own (docs/operations)
    engine: EngineConfig = field(default_factory=EngineConfig)
    limits: Limits = field(default_factory=Limits)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    tenancy: TenancyConfig = field(default_factory=TenancyConfig)
    trace_retention_s: int = tracing.DEFAULT_RETENTION_S  # session traces in Redis; 0: off

    @classmethod
    def from_config(cls, cfg: LockstepConfig) -> SchedulerConfig:
        limits = cfg.limits
        if cfg.sampler.kind != "local":
            # A run whose rank the vLLM/SGLang server cannot hold would fail at its first
            # sample: refuse it when it is created instead.
            limits = replace(
                limits, max_lora_rank=min(limits.max_lora_rank, cfg.sampler.max_lora_rank)
            )
        # required flags of the scheduler's command line (lockstep.config.sections)
        assert cfg.scheduler.listen and cfg.scheduler.redis_url and cfg.model.dir
        return cls(
            listen=cfg.scheduler.listen,
            redis_url=cfg.scheduler.redis_url,
            data_dir=cfg.data_dir.resolve(),
            model_dir=cfg.model.dir.resolve(),
            served_names=cfg.model.served_names,
            image_dir=None if cfg.model.image_dir is None else cfg.model.image_dir.resolve(),
            clock=cfg.clock,
            max_sample_batch=cfg.scheduler.max_sample_batch,
            metrics_host=cfg.metrics.host,
            metrics_port=cfg.metrics.port,
            metrics_max_tenants=cfg.metrics.max_tenants,
            engine=cfg.engine,
            limits=limits,
            sampler=cfg.sampler,
            tenancy=cfg.tenancy,
            trace_retention_s=cfg.metrics.trace_retention_s,
        )


@dataclass
class Assembly:
    """The scheduler's parts, wired: what `serve` runs (and what tests drive in-process)."""

    store: Store
    board: FutureBoard
    lane: SamplingLane
    clock: Clock
    catalog: Catalog
    submissions: Submissions
    tenancy: tenancy_mod.Tenancy

    def service(self, health: Callable[[], Awaitable[dict[str, str]]]) -> pb_grpc.SchedulerServicer:
        """The gRPC servicer: one role object per part of the API, one error mapping."""
        return servicer(
            FutureRpcs(
                self.store,
                self.catalog,
                self.submissions,
                self.board,
                self.tenancy.trail,
                self.clock.queue_state,
            ),
            CatalogRpcs(self.store, self.catalog, self.submissions, health),
            TenancyRpcs(self.tenancy),
        )


def assemble(
    cfg: SchedulerConfig, store: Store, trainer: TrainingEngine, sampler: SamplingEngine
) -> Assembly:
    card = trainer.card()
    board = FutureBoard(store)
    lane = SamplingLane(
        store,
        sampler,
        board,
        cfg.max_sample_batch,
        cfg.sampler.colocate,
        cfg.sampler.slice_steps,
    )
    decoded = DecodedPasses()  # validated at submission, run by dispatch as they are
    recovery = Recovery(
        store,
        trainer,
        cfg.data_dir,
        cfg.tenancy.max_resident_models,
        cfg.engine.snapshot_interval_s,
    )
    dispatcher = Dispatcher(store, trainer, recovery, decoded)
    accounting = Accounting(store, cfg.tenancy.audit_retention_s)
    lane.accounting = accounting
    clock = Clock(
        store,
        dispatcher,
        recovery,
        board,
        lane,
        cfg.clock,
        key_token_cap=cfg.limits.max_tokens_per_cycle_per_key,
        observers=[AccountingObserver(accounting)],  # usage per key (metrics, traces: built in)
    )
    catalog = Catalog(store, card, list(cfg.served_names), cfg.data_dir)
    tenancy = tenancy_mod.Tenancy(
        cfg.tenancy, store, catalog, recovery.resident, accounting, clock.wake.set, lane.unload
    )
    submissions = Submissions(
        store,
        catalog,
        card,
        Engines(trainer.capabilities(), sampler.capabilities()),
        cfg.data_dir,
        on_training=clock.wake.set,
        on_sample=lane.wake.set,
        limits=cfg.limits,
        memory_budget=trainer.memory_budget(),
        decoded=decoded,
        decoded_samples=lane.decoded,
        image_dir=cfg.image_dir,
        custom_loss_created=lambda rec: accounting.custom_loss_created(
            rec.owner, rec.session_id, card.name, rec.loss_id, rec.name
        ),
    )
    return Assembly(store, board, lane, clock, catalog, submissions, tenancy)


# Builds the trainer and the sampler (blocking: it may start processes and wait for them).
EngineFactory = Callable[[], tuple[TrainingEngine, SamplingEngine]]


async def serve(cfg: SchedulerConfig, start_engines: EngineFactory) -> None:
    metrics.configure(cfg.metrics_max_tenants)
    ops = None if cfg.metrics_port is None else start_ops_server(cfg.metrics_host, cfg.metrics_port)
    store = Store.from_url(cfg.redis_url, result_ttl_s=cfg.limits.future_ttl_s)
    await store.ping()
    try:  # before anything reads the state: serve it, migrate it, or refuse it untouched
        await store.prepare_state(cfg.data_dir, redis_label(cfg.redis_url))
        memory_now = await store.memory.check_policy(redis_label(cfg.redis_url))
        log.info("redis memory: %s", memory_now.describe())
    except (StateRefused, EvictingRedis) as exc:
        log.error("refusing to start: %s", exc)
        await store.close()
        raise SystemExit(STATE_REFUSED_EXIT) from exc
    tracing.configure(store.traces, cfg.trace_retention_s)
    trainer, sampler = await asyncio.to_thread(start_engines)
    card = trainer.card()
    log.info(
        "engines ready: %s (vocab %d, context %d) from %s; trainer memory budget %s",
        card.name,
        card.vocab_size,
        card.max_context_length,
        card.directory,
        memory.describe(trainer.memory_budget()),
    )
    metrics.TRAINER_PATH.labels(path=card.trainer_path.value).set(1)
    for engine, kernels in (
        ("trainer", trainer.capabilities().kernels),
        ("sampler", sampler.capabilities().kernels),
    ):
        for k in kernels:
            metrics.HYBRID_KERNEL.labels(engine, k.kernel.value, k.implementation.value).set(1)
    parts = assemble(cfg, store, trainer, sampler)
    clock, lane = parts.clock, parts.lane

    async def health() -> dict[str, str]:
        parts = {}
        try:
            parts["redis"] = "ready" if await store.ping() else "no answer"
        except Exception as exc:
            parts["redis"] = f"unreachable: {exc}"
        for name, engine in (("trainer", trainer), ("sampler", sampler)):
            parts[name] = "ready" if engine.alive() else "process exited"
        return parts

    server = grpc.aio.server(options=grpc_options.server_options(512 << 20))
    pb_grpc.add_SchedulerServicer_to_server(parts.service(health), server)
    server.add_insecure_port(cfg.listen)
    await server.start()
    log.info("scheduler listening on %s (redis %s)", cfg.listen, cfg.redis_url)
    runtime.settle_heap()

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    tasks = [
        _labelled_task(clock.run(), metrics.RedisCaller.CLOCK_AFTER),
        _labelled_task(lane.run(), metrics.RedisCaller.SAMPLING),
    ]
    # Background scans with nothing to drain: cancelled at shutdown, not waited for.
    scans = [
        asyncio.create_task(parts.tenancy.run_expiry()),
        asyncio.create_task(metrics.probe_redis(store.ping)),
        asyncio.create_task(store.memory.run()),
    ]
    if ops is not None:
        ops.health = health
    clock.wake.set()  # pick up work queued before a restart
    await stop.wait()
    log.info("scheduler draining")
    for scan in scans:
        scan.cancel()
    tasks += scans
    clock.stop()
    lane.stop()
    await server.stop(grace=5)
    for task in tasks:
        with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
            await asyncio.wait_for(task, timeout=30)
    # Each engine process takes a second or so to exit (torch's teardown): close both at once.
    await asyncio.gather(asyncio.to_thread(trainer.close), asyncio.to_thread(sampler.close))
    parts.submissions.custom_losses.pricer.close()
    await store.close()
    if ops is not None:
        ops.close()
    log.info("scheduler stopped")


def _labelled_task(coro: Coroutine[Any, Any, None], caller: str) -> asyncio.Task[None]:
    """A task whose Redis round trips count under `caller` (lockstep_redis_round_trips_total)."""
    context = contextvars.copy_context()
    context.run(metrics.REDIS_CALLER.set, caller)
    return asyncio.create_task(coro, context=context)


def build_parser(base: LockstepConfig | None = None) -> argparse.ArgumentParser:
    """`python -m lockstep.scheduler` flags (generated from lockstep.config)."""
    return config.build_parser(
        "scheduler", base or LockstepConfig(), prog="python -m lockstep.scheduler"
    )


def parse_args(argv: list[str] | None = None) -> SchedulerConfig:
    """The scheduler's flags, or `--config FILE` as `lockstep serve` starts it."""
    base = config.base_config(argv)
    parser = build_parser(base)
    return SchedulerConfig.from_config(
        config.resolve(parser, base, parser.parse_args(argv), "scheduler")
    )
