"""Shared workload for the megatron tests: 3 tenants with different ranks in one packed cycle."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from lockstep.engine.interface import TrainingEngine
from lockstep.engine.types import AdamConfig, Datum, LoraSpec, OptimRequest, PassRequest
from lockstep.modeling.peft_io import load_peft_adapter

V = 1024  # the tiny model's vocabulary
TENANTS = {  # different ranks, alphas and targets, packed into one cycle
    "t4": LoraSpec(rank=4, alpha=8.0, seed=1),
    "t8": LoraSpec(rank=8, alpha=16.0, seed=2, train_unembed=False),
    "t16": LoraSpec(rank=16, alpha=16.0, seed=3),
}
ADAM = {
    "t4": AdamConfig(learning_rate=1e-2, weight_decay=0.01),
    "t8": AdamConfig(learning_rate=5e-3, grad_clip_norm=0.5),  # clipping: global norm over ranks
    "t16": AdamConfig(learning_rate=1e-2),
}


def data(seed: int, loss_fn: str, n: int) -> list[Datum]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        t = int(rng.integers(5, 30))
        inputs: dict[str, np.ndarray] = {"target_tokens": rng.integers(0, V, t)}
        if loss_fn == "cross_entropy":
            inputs["weights"] = rng.random(t).astype(np.float32)
        else:
            inputs["logprobs"] = (-rng.random(t) * 8).astype(np.float32)
            inputs["advantages"] = rng.standard_normal(t).astype(np.float32)
        out.append(Datum(rng.integers(0, V, t), inputs))
    return out


def cycle_requests(step: int) -> list[PassRequest]:
    """One cycle: each tenant's forward_backward (different losses), plus a forward-only eval."""
    return [
        PassRequest(
            f"t4-{step}", "t4", "cross_entropy", {}, False, data(10 + step, "cross_entropy", 3)
        ),
        PassRequest(f"t8-{step}", "t8", "ppo", {}, False, data(20 + step, "ppo", 2)),
        PassRequest(
            f"t16-{step}",
            "t16",
            "importance_sampling",
            {},
            False,
            data(30 + step, "importance_sampling", 4),
        ),
        PassRequest(
            f"t4-eval-{step}", "t4", "cross_entropy", {}, True, data(40 + step, "cross_entropy", 1)
        ),
    ]


def run_workload(engine: TrainingEngine, out_dir: Path, steps: int = 2) -> dict[str, object]:
    """Create the tenants, run `steps` cycles (passes + one batched step); record everything."""
    for model_id, spec in TENANTS.items():
        engine.create_model(model_id, spec)
    record: dict[str, object] = {}
    for step in range(steps):
        results = engine.run_passes(cycle_requests(step))
        for r in results:
            record[f"{r.request_id}/loss"] = r.metrics["loss:sum"]
            for j, o in enumerate(r.outputs):
                record[f"{r.request_id}/{j}/logprobs"] = o["logprobs"]
        metrics = engine.optim_step([OptimRequest(m, ADAM[m]) for m in TENANTS])
        for m, met in metrics.items():
            record[f"{m}/{step}/grad_norm"] = met["grad_norm:mean"]
            record[f"{m}/{step}/step"] = met["step:max"]
    for model_id in TENANTS:
        engine.export_adapter(model_id, out_dir / model_id)
        state = load_peft_adapter(out_dir / model_id).state
        for key, tensor in state.items():
            record[f"{model_id}/adapter/{key}"] = tensor
    return record


def assert_records_close(
    got: dict[str, object], want: dict[str, object], tol: float = 1e-5
) -> float:
    """Every value within `tol` (absolute; relative for |values| > 1, e.g. a 166.0 loss:sum,
    where 1e-5 is one fp32 ulp). Returns the worst absolute difference."""
    assert set(got) == set(want)
    worst = 0.0
    for key, w in want.items():
        g = np.asarray(got[key], np.float64)
        w64 = np.asarray(w, np.float64)
        diff = float(np.max(np.abs(g - w64)))
        scale = max(1.0, float(np.max(np.abs(w64))))
        assert diff <= tol * scale, f"{key}: differs by {diff:.3g} (|value| {scale:.3g})"
        worst = max(worst, diff)
    return worst
