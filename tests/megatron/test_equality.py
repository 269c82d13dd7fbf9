"""The Megatron engine gives the local engine's numbers (fp32) at every parallel layout.

Real megatron-core ranks (gloo on CPU, one process per rank, torch.multiprocessing — no Ray here;
the Ray path is covered end to end in test_serve.py), 3 tenants of ranks 4, 8 and 16 packed in one
cycle: per-datum logprobs, `loss:sum`, grad norms and the adapters after two optimizer steps.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from lockstep.engine.types import OptimRequest
from lockstep.modeling.tiny import ensure_default_model
from lockstep.workers.local.trainer import LocalTrainingEngine
from lockstep.workers.megatron.parallel import ParallelConfig
from lockstep.workers.megatron.trainer import MegatronTrainingEngine
from tests.megatron.common import ADAM, TENANTS, assert_records_close, cycle_requests, run_workload

LAYOUTS = {
    "tp2": ParallelConfig(tp=2),
    "dp2": ParallelConfig(dp=2),
    "pp2": ParallelConfig(pp=2),  # 9 training rows in micro-batches of 8: two, 1F1B
    "tp2pp2": ParallelConfig(tp=2, pp=2),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_default_model(Path.home() / ".cache" / "lockstep-test-models")


@pytest.fixture(scope="module")
def reference(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    engine = LocalTrainingEngine(model_dir, "tiny", device="cpu")
    return run_workload(engine, tmp_path_factory.mktemp("local"))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_local_engine(
    layout: str, model_dir: Path, reference: dict[str, object], tmp_path: Path
) -> None:
    engine = MegatronTrainingEngine(model_dir, "tiny", LAYOUTS[layout], launcher="process")
    try:
        got = run_workload(engine, tmp_path)
    finally:
        engine.close()
    worst = assert_records_close(got, reference)
    print(f"{layout}: worst abs difference {worst:.3g} over {len(reference)} values")


def test_checkpoints_move_between_engines(model_dir: Path, tmp_path: Path) -> None:
    """A local save_state resumes on megatron TP=2 (equal next losses and step), and a megatron
    save_state resumes on the local engine."""
    local = LocalTrainingEngine(model_dir, "tiny", device="cpu")
    run_workload(local, tmp_path / "warmup", steps=1)
    for m in TENANTS:
        local.save_state(m, tmp_path / "ckpt" / m, include_optimizer=True)
    megatron = MegatronTrainingEngine(model_dir, "tiny", ParallelConfig(tp=2), launcher="process")
    try:
        for m in TENANTS:
            assert megatron.load_state(
                m, tmp_path / "ckpt" / m, include_optimizer=True
            ) == local._lora.spec(m)

        def step(engine: LocalTrainingEngine | MegatronTrainingEngine) -> dict[str, object]:
            out: dict[str, object] = {}
            for r in engine.run_passes(cycle_requests(1)):
                out[r.request_id] = r.metrics["loss:sum"]
            for m, met in engine.optim_step([OptimRequest(m, ADAM[m]) for m in TENANTS]).items():
                out[m] = met["grad_norm:mean"]
                out[f"{m}/step"] = met["step:max"]  # 2: the Adam state came along
            return out

        assert_records_close(step(megatron), step(local))
        for m in TENANTS:
            megatron.save_state(m, tmp_path / "back" / m, include_optimizer=True)
        back = LocalTrainingEngine(model_dir, "tiny", device="cpu")
        for m in TENANTS:
            back.load_state(m, tmp_path / "back" / m, include_optimizer=True)
        assert_records_close(step(back), step(megatron))
    finally:
        megatron.close()


def test_context_parallel_without_transformer_engine_is_refused(model_dir: Path) -> None:
    with pytest.raises(ValueError, match="--cp .*Transformer Engine"):
        MegatronTrainingEngine(model_dir, "tiny", ParallelConfig(cp=2), launcher="process")
    with pytest.raises(ValueError, match="--sequence-parallel"):
        ParallelConfig(tp=2, sequence_parallel=True).check_backend()
    with pytest.raises(ValueError, match="--tp 3 must divide"):
        MegatronTrainingEngine(model_dir, "tiny", ParallelConfig(tp=3), launcher="process")
    with pytest.raises(ValueError, match="--dp must be an integer >= 1"):
        ParallelConfig(dp=0)
