"""The engine factory: build the training and sampling engines the config names.

The scheduler only talks to the engine contract (`lockstep.engine.interface`); which backend
stands behind it is decided here, by whoever starts the scheduler (`python -m
lockstep.scheduler` passes `start_engines` to `scheduler.server.serve`). So the scheduler
package imports no worker or rollout code, and tests hand it engines of their own.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

from lockstep.config import EngineConfig, SamplerConfig
from lockstep.engine.interface import SamplingEngine, TrainingEngine
from lockstep.rollout import config as rollout_config
from lockstep.workers.process import Deadline, ProcessTrainingEngine


def start_engines(
    engine: EngineConfig,
    sampler: SamplerConfig,
    model_dir: Path,
    served_name: str,
    data_dir: Path,
) -> tuple[TrainingEngine, SamplingEngine]:
    """The trainer (local torch, or the Megatron ranks' driver) in its own child process; the
    configured sampler (rollout.config). Blocks until both are up."""
    from lockstep.workers.local.trainer import LocalTrainingEngine  # imports torch

    factory: Callable[[], TrainingEngine] = functools.partial(
        LocalTrainingEngine,
        model_dir,
        served_name,
        micro_batch_tokens=engine.micro_batch_tokens,
        dtype=engine.dtype,
        activation_checkpointing=engine.activation_checkpointing,
        memory_budget_bytes=engine.memory_budget_bytes,
    )
    if engine.kind == "megatron":  # the child process drives the Ray worker group
        from lockstep.workers.megatron.trainer import MegatronTrainingEngine

        factory = functools.partial(
            MegatronTrainingEngine,
            model_dir,
            served_name,
            engine.parallel,
            "ray",
            engine.ray_address,
            engine.micro_batch,
            engine.ray_placement,
            engine.memory_budget_bytes,
        )
    deadline = Deadline(engine.deadline_s, engine.deadline_per_token_s)
    trainer = ProcessTrainingEngine(factory, "trainer", deadline)
    sampling = rollout_config.start_sampler(sampler, model_dir, served_name, data_dir, deadline)
    return trainer, sampling
