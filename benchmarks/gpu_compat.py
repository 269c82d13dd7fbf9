"""The `compat` section of `gpu_suite.py`: every family of the zoo loads and trains on this GPU
under the lowest and the highest transformers release Lockstep supports.

The suite runs with the carried (highest tested) transformers shadowing the image's own (the
GPU image ships the lowest, 5.17); this section runs `check()` in the suite's process and again
in a child process whose PYTHONPATH leaves the carried release out. Per family: the tiny random
model of `lockstep.modeling.zoo` in bf16 on the device, 8 tenants, one packed cycle
(forward_backward + optim_step) and the trainer path. Beside them, a Qwen3-MoE of 256 experts:
8 tenants put 2048 (adapter, expert) groups in one layer, twice what CUDA's grouped GEMM takes in
one call (`modeling/grouped_gemm.py` cuts them), and a tenant alone must equal packed.

    python benchmarks/gpu_compat.py OUT.json     # the child's entry point
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lockstep.engine.types import AdamConfig, Datum, LoraSpec, OptimRequest, PassRequest
from lockstep.modeling import zoo
from lockstep.workers.local.trainer import LocalTrainingEngine

TENANTS = 8
# A Qwen3-MoE with as many experts as Qwen3.6-35B-A3B: 8 tenants make 2048 groups per layer.
WIDE_MOE = {**zoo.FAMILIES["qwen3_moe"], "num_experts": 256, "num_experts_per_tok": 8}


def _datum(seed: int, length: int = 48) -> Datum:
    t = np.random.default_rng(seed).integers(5, 1000, size=length + 1)
    targets = {"target_tokens": t[1:].astype(np.int64), "weights": np.ones(length, "f4")}
    return Datum(tokens=t[:-1].astype(np.int64), loss_inputs=targets)


def _cycle(directory: Path, name: str, device: str, alone_equals_packed: bool) -> dict[str, Any]:
    engine = LocalTrainingEngine(directory, name, device=device, dtype="bfloat16")
    try:
        tenants = [f"t{i}" for i in range(TENANTS)]
        for i, t in enumerate(tenants):
            engine.create_model(t, LoraSpec(rank=8, seed=i))
        requests = [
            PassRequest(f"r{i}", t, "cross_entropy", {}, False, [_datum(i)])
            for i, t in enumerate(tenants)
        ]
        packed = engine.run_passes(requests)
        out: dict[str, Any] = {
            "trainer_path": engine.card().trainer_path.value,
            "loss": packed[0].metrics["loss:sum"],
        }
        if alone_equals_packed:  # forward only: no gradient left behind
            forward = [
                PassRequest(r.request_id, r.model_id, r.loss_fn, {}, True, r.data) for r in requests
            ]
            together = engine.run_passes(forward)
            alone = engine.run_passes(forward[:1])
            a, b = (np.asarray(x[0].outputs[0]["logprobs"]) for x in (alone, together))
            out["alone_vs_packed_max_abs_logprob_diff"] = float(np.abs(a - b).max())
        engine.optim_step([OptimRequest(t, AdamConfig(learning_rate=1e-4)) for t in tenants])
        return out
    finally:
        engine.close()


# What a CPU smoke run of the suite checks (the script's paths, in seconds).
SMOKE_FAMILIES = ("qwen3", "qwen3_moe", "nemotron_h")


def check(device: str, families: tuple[str, ...] = tuple(zoo.FAMILIES)) -> dict[str, Any]:
    """`families` of the zoo and the 256-expert MoE: one packed cycle each (errors recorded)."""
    import transformers

    results: dict[str, Any] = {"transformers": transformers.__version__}
    with tempfile.TemporaryDirectory(prefix="compat-") as tmp:
        cache = Path(tmp)
        models = {f: (zoo.ensure_family(f, cache), zoo.served_name(f)) for f in families}
        models["qwen3_moe_256_experts"] = (
            zoo.ensure_model("tiny-qwen3-moe-256", WIDE_MOE, cache),
            "Lockstep/tiny-qwen3-moe-256",
        )
        for family, (directory, name) in models.items():
            try:
                wide = family == "qwen3_moe_256_experts"
                results[family] = _cycle(directory, name, device, alone_equals_packed=wide)
            except Exception as exc:
                results[family] = {"error": repr(exc), "traceback": traceback.format_exc(limit=4)}
            if device == "cuda":
                torch.cuda.empty_cache()
    return results


def compat_section(device: str, smoke: bool) -> dict[str, Any]:
    """`check` here (the release this process imports) and in a child without the carried one,
    when one shadows the image's (otherwise the child would import the same release)."""
    import transformers

    out = {"imported": check(device, SMOKE_FAMILIES if smoke else tuple(zoo.FAMILIES))}
    carried = str(Path(transformers.__file__).resolve().parents[1])
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if carried not in [str(Path(p).resolve()) for p in paths if p]:
        out["image"] = {"skipped": "no carried transformers shadows the installed one"}
        return out
    kept = [p for p in paths if p and str(Path(p).resolve()) != carried]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(kept)}
    with tempfile.TemporaryDirectory(prefix="compat-child-") as tmp:
        result = Path(tmp) / "compat.json"
        proc = subprocess.run(
            [sys.executable, __file__, str(result), device],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        if proc.returncode != 0 or not result.is_file():
            out["image"] = {"error": proc.stderr[-3000:]}
        else:
            out["image"] = json.loads(result.read_text())
    return out


def failures(section: dict[str, Any]) -> list[str]:
    """`release: family` of every family that failed under either release."""
    failed = []
    for side in ("imported", "image"):
        results = section.get(side, {})
        if "error" in results:
            failed.append(f"{side}: {results['error'][-200:]}")
            continue
        version = results.get("transformers", side)
        for family, result in results.items():
            if isinstance(result, dict) and "error" in result:
                failed.append(f"{version}: {family}: {result['error'][:200]}")
    return failed


if __name__ == "__main__":
    target = Path(sys.argv[1])
    chosen = sys.argv[2] if len(sys.argv) > 2 else ("cuda" if torch.cuda.is_available() else "cpu")
    target.write_text(json.dumps(check(chosen), indent=2, default=str) + "\n")
