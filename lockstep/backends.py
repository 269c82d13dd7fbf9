"""The engine factory: build the training and sampling engines the config names.

The scheduler only talks to the engine contract (`lockstep.engine.interface`); which backend
stands behind it is decided here, by whoever starts the scheduler (`python -m
lockstep.scheduler` passes `start_engines` to `scheduler.server.serve`). So the scheduler
package imports no worker or rollout code, and tests hand it engines of their own.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from lockstep.config import EngineConfig, SamplerConfig
from lockstep.engine.interface import EngineDied, SamplingEngine, TrainingEngine
from lockstep.rollout import config as rollout_config
from lockstep.workers.process import Deadline, NamedFactory, ProcessTrainingEngine


def start_engines(
    engine: EngineConfig,
    sampler: SamplerConfig,
    model_dir: Path,
    served_name: str,
    data_dir: Path,
) -> tuple[TrainingEngine, SamplingEngine]:
    """The trainer (local torch, or the Megatron ranks' driver) in its own child process; the
    configured sampler (rollout.config). Blocks until both are up."""
    # Named, not imported: the engine's process loads torch, this one never does.
    factory = NamedFactory(
        "lockstep.workers.local.trainer:LocalTrainingEngine",
        (model_dir, served_name),
        {
            "micro_batch_tokens": engine.micro_batch_tokens,
            "dtype": engine.dtype,
            "activation_checkpointing": engine.activation_checkpointing,
            "memory_budget_bytes": engine.memory_budget_bytes,
        },
    )
    if engine.kind == "megatron":  # the child process drives the Ray worker group
        factory = NamedFactory(
            "lockstep.workers.megatron.trainer:MegatronTrainingEngine",
            (
                model_dir,
                served_name,
                engine.parallel,
                "ray",
                engine.ray_address,
                engine.micro_batch,
                engine.ray_placement,
                engine.memory_budget_bytes,
            ),
        )
    deadline = Deadline(engine.deadline_s, engine.deadline_per_token_s)
    if sampler.kind != "local":
        # Launched after the trainer, from this thread: an external engine's launcher ties the
        # engine's life to the thread that launched it (PR_SET_PDEATHSIG, rollout/launcher.py).
        trainer = ProcessTrainingEngine(factory, "trainer", deadline)
        try:
            sampling = rollout_config.start_sampler(
                sampler, model_dir, served_name, data_dir, deadline
            )
        except BaseException:
            trainer.close()
            raise
        return trainer, sampling
    # The local sampler's process starts beside the trainer's (its imports overlap the trainer's
    # start) and loads its model once the trainer is up, which has then measured the memory left
    # to it.
    trainer_up: Future[None] = Future()
    with ThreadPoolExecutor(1, thread_name_prefix="sampler-start") as pool:
        local = pool.submit(
            rollout_config.start_sampler,
            sampler,
            model_dir,
            served_name,
            data_dir,
            deadline,
            trainer_up,
        )
        try:
            trainer = ProcessTrainingEngine(factory, "trainer", deadline)
        except BaseException as exc:
            trainer_up.set_exception(EngineDied(f"the trainer did not start: {exc}"))
            raise
        trainer_up.set_result(None)
        try:
            return trainer, local.result()
        except BaseException:
            trainer.close()
            raise
