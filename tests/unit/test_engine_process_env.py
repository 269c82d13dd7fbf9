"""What an engine process's environment holds (lockstep/workers/process.py, ENGINE_ENV): OpenMP
workers that sleep between calls instead of spinning on the cores the other processes need,
unless the operator's environment says otherwise; and an engine's numbers in its process are the
numbers in-process, bit for bit."""

from __future__ import annotations

import os
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch

from lockstep.engine.types import Datum, LoraSpec, PassRequest
from lockstep.modeling.tiny import DEFAULT_MODEL_NAME, ensure_default_model
from lockstep.workers.local.trainer import LocalTrainingEngine
from lockstep.workers.process import EngineProcess, ProcessTrainingEngine, share_cores


class Environ:
    """A FAKE engine that reports its process's environment."""

    def env(self, name: str) -> str | None:
        return os.environ.get(name)

    def close(self) -> None:
        pass


def test_an_engine_process_waits_passively_unless_told_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    proc = EngineProcess(Environ, "environ")
    try:
        assert proc.call("env", "OMP_WAIT_POLICY") == "PASSIVE"
    finally:
        proc.close()
    assert "OMP_WAIT_POLICY" not in os.environ  # the parent's own environment is untouched

    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # the operator's choice wins
    proc = EngineProcess(Environ, "environ")
    try:
        assert proc.call("env", "OMP_WAIT_POLICY") == "ACTIVE"
    finally:
        proc.close()


def test_a_forward_in_the_engine_process_is_the_forward_in_process(tmp_path: Path) -> None:
    model_dir = ensure_default_model(tmp_path / "models")
    datum = Datum(
        np.array([5, 9, 14, 3]),
        {"target_tokens": np.array([9, 14, 3, 7]), "weights": np.ones(4, np.float32)},
    )
    request = PassRequest("r", "m", "cross_entropy", {}, True, [datum])
    spec = LoraSpec(rank=8, seed=1)
    threads = torch.get_num_threads()
    share_cores()  # the engine process's threads here too: only the process differs
    local = LocalTrainingEngine(model_dir, DEFAULT_MODEL_NAME, device="cpu")
    local.create_model("m", spec)
    child = ProcessTrainingEngine(
        partial(LocalTrainingEngine, model_dir, DEFAULT_MODEL_NAME, device="cpu")
    )
    try:
        child.create_model("m", spec)
        (here,) = local.run_passes([request])
        (there,) = child.run_passes([request])
        assert here.metrics == there.metrics
        for name, value in here.outputs[0].items():
            assert np.array_equal(value, there.outputs[0][name]), name
    finally:
        child.close()
        local.close()
        torch.set_num_threads(threads)
