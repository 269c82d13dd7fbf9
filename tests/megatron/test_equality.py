"""The Megatron engine gives the local engine's numbers (fp32) at every parallel layout.

Real megatron-core ranks (gloo on CPU, one process per rank, torch.multiprocessing — no Ray here;
the Ray path is covered end to end in test_serve.py), 3 tenants of ranks 4, 8 and 16 packed in one
cycle: per-datum logprobs, `loss:sum`, grad norms and the adapters after two optimizer steps.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from lockstep.engine.parts import join_results, part_request
from lockstep.engine.types import OptimRequest
from lockstep.modeling.peft_io import load_peft_adapter
from lockstep.modeling.tiny import ensure_default_model
from lockstep.workers.local.trainer import LocalTrainingEngine
from lockstep.workers.megatron.parallel import ParallelConfig
from lockstep.workers.megatron.trainer import MegatronTrainingEngine
from tests.megatron.common import ADAM, TENANTS, assert_records_close, cycle_requests, run_workload

CUTS = [(0, 1), (1, 3)]  # a 3-datum request in two parts
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


def test_a_request_in_parts_and_a_failed_one_on_megatron(model_dir: Path, tmp_path: Path) -> None:
    """DP=2 (each part's rows split over the replicas): a request in two parts joins to its
    whole pass; a request whose later part failed is undone (`undo_parts`) on every rank, so a
    tenant that ran it then the whole request steps exactly like one that ran the whole only."""
    engine = MegatronTrainingEngine(model_dir, "tiny", ParallelConfig(dp=2), launcher="process")
    try:
        for m in ("whole", "parts", "undone"):
            engine.create_model(m, TENANTS["t4"])
        req = cycle_requests(0)[0]  # 3 datums
        (want,) = engine.run_passes([dataclasses.replace(req, model_id="whole")])
        mine = dataclasses.replace(req, model_id="parts")
        got = join_results([engine.run_passes([part_request(mine, a, b)])[0] for a, b in CUTS])
        assert got.metrics["loss:sum"] == pytest.approx(want.metrics["loss:sum"], rel=1e-5)
        for a, b in zip(got.outputs, want.outputs, strict=True):
            np.testing.assert_allclose(a["logprobs"], b["logprobs"], rtol=0, atol=1e-5)
        failed = dataclasses.replace(req, model_id="undone")
        engine.run_passes([part_request(failed, *CUTS[0])])  # its LAST part then failed
        engine.undo_parts("undone")
        engine.run_passes([failed])
        engine.optim_step([OptimRequest(m, ADAM["t4"]) for m in ("whole", "parts", "undone")])
        states = {}
        for m in ("whole", "parts", "undone"):
            engine.export_adapter(m, tmp_path / m)
            states[m] = load_peft_adapter(tmp_path / m).state
    finally:
        engine.close()
    for m in ("parts", "undone"):
        for key, tensor in states["whole"].items():
            np.testing.assert_allclose(states[m][key], tensor, rtol=0, atol=1e-5, err_msg=key)
