"""The REAL local training engine in a process whose memory is capped with RLIMIT_AS, for
tests of what a trainer does under a memory limit (the engine process imports this module)."""

from __future__ import annotations

import resource
from pathlib import Path

from lockstep.engine.memory import address_space
from lockstep.workers.local.trainer import LocalTrainingEngine


def limited_trainer(
    model_dir: Path, served_name: str, headroom: int, micro_batch_tokens: int
) -> LocalTrainingEngine:
    """Cap this process's address space at what it maps now (torch imported) plus `headroom`
    bytes, then load the engine: its memory budget comes from the room left under the cap."""
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (address_space() + headroom, hard))
    return LocalTrainingEngine(model_dir, served_name, micro_batch_tokens=micro_batch_tokens)
