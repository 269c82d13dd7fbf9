"""Background snapshots of the local engine: the state is copied when `snapshot` returns, written
(fsynced, renamed) later, reported durable once, and equal to a synchronous save_state."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from lockstep.engine.types import AdamConfig, Datum, LoraSpec, OptimRequest, PassRequest
from lockstep.modeling.tiny import ensure_default_model
from lockstep.workers.local.trainer import LocalTrainingEngine
from lockstep.workers.snapshots import SnapshotWriter


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> LocalTrainingEngine:
    return LocalTrainingEngine(
        ensure_default_model(tmp_path_factory.mktemp("cache")), "tiny", device="cpu"
    )


def _train(engine: LocalTrainingEngine, model: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 200, 12)
    datum = Datum(tokens, {"target_tokens": rng.integers(0, 200, 12)})
    engine.run_passes([PassRequest("r", model, "cross_entropy", {}, False, [datum])])
    engine.optim_step([OptimRequest(model, AdamConfig(learning_rate=1e-2))])


def _files(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update({f"{f.name}:{k}": v for k, v in load_file(f).items()})
    return out


def test_a_background_snapshot_holds_the_state_of_its_call(
    engine: LocalTrainingEngine, tmp_path: Path
) -> None:
    engine.create_model("m", LoraSpec(rank=4, seed=3))
    _train(engine, "m", 1)
    engine.save_state("m", tmp_path / "sync", True)
    assert engine.snapshot("m", tmp_path / "seq-2") is False  # written in the background
    _train(engine, "m", 2)  # the model moves on at once; the snapshot must not see it
    engine._snapshots.flush()
    assert engine.durable_snapshots() == [("m", tmp_path / "seq-2")]
    assert engine.durable_snapshots() == []  # reported once
    assert not (tmp_path / "seq-2.tmp").exists()
    sync, background = _files(tmp_path / "sync"), _files(tmp_path / "seq-2")
    assert sync.keys() == background.keys() and any("optimizer" in k for k in sync)
    for name, tensor in sync.items():
        assert torch.equal(tensor, background[name]), name


def test_a_failed_background_write_is_never_reported(tmp_path: Path) -> None:
    writer = SnapshotWriter()

    def broken(directory: Path) -> int:
        directory.mkdir()
        raise OSError(28, "No space left on device")

    writer.submit("m", tmp_path / "seq-1", broken)
    writer.submit("m", tmp_path / "seq-2", lambda d: d.mkdir() or 0)
    writer.flush()
    assert writer.durable() == [("m", tmp_path / "seq-2")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["seq-2"]  # nothing half-written
    writer.close()
