"""The scheduler process: Redis state, the engines (child processes), the clock, the gRPC server."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import logging
import signal
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import grpc

from lockstep import limits as limits_mod
from lockstep.engine.interface import SamplingEngine, TrainingEngine
from lockstep.observability import metrics
from lockstep.observability.ops_server import start_ops_server
from lockstep.rollout import config as rollout_config
from lockstep.scheduler.catalog import Catalog
from lockstep.scheduler.clock import Clock, ClockConfig
from lockstep.scheduler.dispatch import Dispatcher
from lockstep.scheduler.futures import FutureBoard
from lockstep.scheduler.sampling_lane import SamplingLane
from lockstep.scheduler.service import SchedulerService
from lockstep.scheduler.store import Store
from lockstep.scheduler.submissions import Submissions
from lockstep.v1 import scheduler_pb2_grpc as pb_grpc
from lockstep.workers.megatron import options as engine_options

log = logging.getLogger("lockstep.scheduler")


@dataclass(frozen=True)
class SchedulerConfig:
    listen: str  # gRPC address, e.g. "127.0.0.1:50051" or "unix:/path/sock"
    redis_url: str
    data_dir: Path
    model_dir: Path
    served_names: tuple[str, ...]
    clock: ClockConfig = field(default_factory=ClockConfig)
    max_sample_batch: int = 64
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None  # /metrics, /healthz, /livez; None: not served; 0: any port
    metrics_max_tenants: int = 32  # owners with per-tenant series of their own (docs/operations)
    engine: engine_options.EngineOptions = field(default_factory=engine_options.EngineOptions)
    limits: limits_mod.Limits = field(default_factory=limits_mod.Limits)
    sampler: rollout_config.SamplerConfig = field(default_factory=rollout_config.SamplerConfig)


def start_engines(cfg: SchedulerConfig) -> tuple[TrainingEngine, SamplingEngine]:
    """The local trainer in its own child process; the configured sampler (rollout.config)."""
    from lockstep.workers.local.engine import LocalTrainingEngine
    from lockstep.workers.process import ProcessTrainingEngine

    name = cfg.served_names[0]
    factory: Callable[[], TrainingEngine] = functools.partial(
        LocalTrainingEngine, cfg.model_dir, name)
    if cfg.engine.engine == "megatron":  # the child process drives the Ray worker group
        from lockstep.workers.megatron.engine import MegatronTrainingEngine

        factory = functools.partial(MegatronTrainingEngine, cfg.model_dir, name,
                                    cfg.engine.parallel, "ray", cfg.engine.ray_address,
                                    cfg.engine.micro_batch)
    trainer = ProcessTrainingEngine(factory, "trainer")
    sampler = rollout_config.start_sampler(cfg.sampler, cfg.model_dir, name, cfg.data_dir)
    return trainer, sampler


async def serve(cfg: SchedulerConfig) -> None:
    metrics.configure(cfg.metrics_max_tenants)
    ops = None if cfg.metrics_port is None else start_ops_server(cfg.metrics_host,
                                                                  cfg.metrics_port)
    store = Store.from_url(cfg.redis_url, result_ttl_s=cfg.limits.future_ttl_s)
    await store.ping()
    trainer, sampler = await asyncio.to_thread(start_engines, cfg)
    card = trainer.card()
    log.info("engines ready: %s (vocab %d, context %d) from %s", card.name, card.vocab_size,
             card.max_context_length, card.directory)
    board = FutureBoard(store)
    lane = SamplingLane(store, sampler, board, cfg.max_sample_batch, cfg.sampler.colocate)
    clock = Clock(store, Dispatcher(store, trainer, cfg.data_dir), board, lane, cfg.clock,
                  key_token_cap=cfg.limits.max_tokens_per_cycle_per_key)
    catalog = Catalog(store, card, list(cfg.served_names), cfg.data_dir)
    submissions = Submissions(store, catalog, card, cfg.data_dir,
                              on_training=clock.wake.set, on_sample=lane.wake.set,
                              limits=cfg.limits)

    async def health() -> dict[str, str]:
        parts = {}
        try:
            parts["redis"] = "ready" if await store.ping() else "no answer"
        except Exception as exc:
            parts["redis"] = f"unreachable: {exc}"
        for name, engine in (("trainer", trainer), ("sampler", sampler)):
            alive = getattr(engine, "process", None)
            parts[name] = "ready" if alive is None or alive.alive() else "process exited"
        return parts

    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 512 << 20),
                                      ("grpc.max_send_message_length", 512 << 20)])
    pb_grpc.add_SchedulerServicer_to_server(
        SchedulerService(store, catalog, submissions, board, health, clock.queue_state), server)
    server.add_insecure_port(cfg.listen)
    await server.start()
    log.info("scheduler listening on %s (redis %s)", cfg.listen, cfg.redis_url)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    tasks = [asyncio.create_task(clock.run()), asyncio.create_task(lane.run())]
    probe = asyncio.create_task(metrics.probe_redis(store.ping))
    if ops is not None:
        ops.health = health
    clock.wake.set()  # pick up work queued before a restart
    await stop.wait()
    log.info("scheduler draining")
    probe.cancel()
    tasks.append(probe)
    clock.stop()
    lane.stop()
    await server.stop(grace=5)
    for task in tasks:
        with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
            await asyncio.wait_for(task, timeout=30)
    trainer.close()
    sampler.close()
    await store.close()
    if ops is not None:
        ops.close()
    log.info("scheduler stopped")


def parse_args(argv: list[str] | None = None) -> SchedulerConfig:
    p = argparse.ArgumentParser(prog="python -m lockstep.scheduler")
    p.add_argument("--listen", required=True)
    p.add_argument("--redis-url", required=True)
    p.add_argument("--data-dir", type=Path, required=True)
    p.add_argument("--model-dir", type=Path, required=True)
    p.add_argument("--served-name", action="append", required=True)
    p.add_argument("--clock-policy", choices=["triggered", "periodic"], default="triggered")
    p.add_argument("--clock-period", type=float, default=1.0)
    p.add_argument("--clock-gather", type=float, default=0.02)
    p.add_argument("--token-budget", type=int, default=65536)
    p.add_argument("--metrics-host", default="127.0.0.1",
                   help="address of the /metrics, /healthz and /livez HTTP server")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="port of that server (0: any free port, logged); omitted: no server")
    p.add_argument("--metrics-max-tenants", type=int, default=32,
                   help="owners with per-tenant metric series of their own; others: 'other'")
    limits_mod.add_scheduler_arguments(p)
    rollout_config.add_arguments(p)
    engine_options.add_arguments(p)
    a = p.parse_args(argv)
    sampler = rollout_config.from_args(a)
    limits = limits_mod.from_scheduler_args(a)
    if sampler.kind != "local":
        # A run whose rank the vLLM/SGLang server cannot hold would fail at its first sample:
        # refuse it when it is created instead.
        limits = replace(limits, max_lora_rank=min(limits.max_lora_rank, sampler.max_lora_rank))
    return SchedulerConfig(
        listen=a.listen, redis_url=a.redis_url, data_dir=a.data_dir.resolve(),
        model_dir=a.model_dir.resolve(), served_names=tuple(a.served_name),
        clock=ClockConfig(policy=a.clock_policy, period_s=a.clock_period,
                          gather_s=a.clock_gather, token_budget=a.token_budget),
        metrics_host=a.metrics_host, metrics_port=a.metrics_port,
        metrics_max_tenants=a.metrics_max_tenants, engine=engine_options.from_args(a),
        limits=limits, sampler=sampler,
    )


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s [scheduler] %(name)s: %(message)s")
    asyncio.run(serve(parse_args(argv)))


if __name__ == "__main__":
    main()
