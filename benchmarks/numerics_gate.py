"""The numerics gate of a faster LoRA path: bf16 LoRA GEMMs (`linear_lora.GROUPED_IN_BASE_DTYPE`,
fp32 adapters, gradients and Adam state) may become the CUDA default only if their logprob error
against an fp32 reference is no larger than the bf16 base path's own (bf16 base weights, fp32
LoRA GEMMs: today's CUDA default).

Per family of the zoo (CPU; bf16 arithmetic is the same format on any device) and seed: three
tenants of ranks 8/16/24 train 3 steps from the same start in three engines (fp32 everything;
bf16 base; bf16 base + bf16 LoRA GEMMs, the grouped path chosen as on CUDA), then one
forward_backward: every datum's target logprobs and every adapter gradient are compared with the
fp32 engine's. Written to benchmarks/results/numerics_gate.json (+ .png): per family the max and
mean absolute logprob error and the gradients' relative error of each bf16 path, over seeds
(median, min, max), and whether the gate passes (the fast path's max logprob error <= the base
path's, at every seed).

    python benchmarks/numerics_gate.py [--families qwen3 qwen3_moe ...] [--seeds 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from common import environment, write_json
from rich.progress import track

from lockstep.engine.types import AdamConfig, Datum, LoraSpec, OptimRequest, PassRequest
from lockstep.modeling import linear_lora, zoo
from lockstep.workers.local.trainer import LocalTrainingEngine

NAME = "numerics_gate"
PATHS = {
    "fp32": ("float32", False),
    "bf16_base": ("bfloat16", False),
    "bf16_lora": ("bfloat16", True),
}
TENANTS = {"a": 8, "b": 16, "c": 24}


def _data(seed: int) -> dict[str, list[Datum]]:
    rng = np.random.default_rng(seed)
    out = {}
    for tenant in TENANTS:
        rows = []
        for n in (64, 40):
            t = rng.integers(5, 1000, size=n + 1)
            targets = {"target_tokens": t[1:].astype(np.int64), "weights": np.ones(n, "f4")}
            rows.append(Datum(tokens=t[:-1].astype(np.int64), loss_inputs=targets))
        out[tenant] = rows
    return out


def _run(directory: Path, dtype: str, fast: bool, seed: int) -> tuple[np.ndarray, torch.Tensor]:
    linear_lora.GROUPED_IN_BASE_DTYPE = fast
    engine = LocalTrainingEngine(directory, "gate", device="cpu", dtype=dtype)
    try:
        data = _data(seed)
        for i, (tenant, rank) in enumerate(TENANTS.items()):
            engine.create_model(tenant, LoraSpec(rank=rank, seed=seed * 10 + i))
        passes = [PassRequest("r", t, "cross_entropy", {}, False, data[t]) for t in TENANTS]
        for _ in range(3):  # B off zero: every LoRA term counts
            engine.run_passes(passes)
            engine.optim_step([OptimRequest(t, AdamConfig(learning_rate=1e-2)) for t in TENANTS])
        out = engine.run_passes(passes)
        lp = np.concatenate([np.asarray(o["logprobs"]) for r in out for o in r.outputs])
        params = [p for t in TENANTS for p in engine._lora.adapter_parameters(t)]
        grads = torch.cat([p.grad.flatten() for p in params if p.grad is not None])
        return lp, grads
    finally:
        engine.close()
        linear_lora.GROUPED_IN_BASE_DTYPE = False


def measure(family: str, directory: Path, seeds: int) -> dict[str, Any]:
    per_seed: list[dict[str, dict[str, float]]] = []
    for seed in range(seeds):
        ref_lp, ref_grad = _run(directory, "float32", False, seed)
        errors = {}
        for path, (dtype, fast) in PATHS.items():
            if path == "fp32":
                continue
            lp, grad = _run(directory, dtype, fast, seed)
            errors[path] = {
                "max_abs_logprob_error": float(np.abs(lp - ref_lp).max()),
                "mean_abs_logprob_error": float(np.abs(lp - ref_lp).mean()),
                "grad_relative_error": float((grad - ref_grad).norm() / ref_grad.norm()),
            }
        per_seed.append(errors)
    summary: dict[str, Any] = {}
    for path in ("bf16_base", "bf16_lora"):
        summary[path] = {}
        for key in per_seed[0][path]:
            values = [s[path][key] for s in per_seed]
            summary[path][key] = {
                "median": statistics.median(values),
                "min": min(values),
                "max": max(values),
            }
    passes = all(
        s["bf16_lora"]["max_abs_logprob_error"] <= s["bf16_base"]["max_abs_logprob_error"]
        for s in per_seed
    )
    return {"seeds": per_seed, "summary": summary, "gate_passes": passes}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--families", nargs="*", default=["qwen3", "qwen3_moe", "qwen3_5", "gpt_oss"])
    p.add_argument("--seeds", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(1)  # the same kernels whatever the box: errors, not speed
    # The grouped LoRA path, as CUDA takes it (on the CPU it is off by default).
    linear_lora.GROUPED_DEVICES = frozenset({"cpu", "cuda"})
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for family in track(args.families, description="numerics gate"):
            directory = zoo.ensure_family(family, Path(tmp))
            results[family] = measure(family, directory, args.seeds)
    payload = {
        "environment": environment(),
        "config": {"families": args.families, "seeds": args.seeds, "tenants": TENANTS},
        "families": results,
        "gate_passes_everywhere": all(r["gate_passes"] for r in results.values()),
    }
    write_json(NAME, payload)
    _figure(results)
    for family, r in results.items():
        base = r["summary"]["bf16_base"]["max_abs_logprob_error"]["median"]
        fast = r["summary"]["bf16_lora"]["max_abs_logprob_error"]["median"]
        print(
            f"{family:<12} max |logprob error|: bf16 base {base:.4f}, bf16 LoRA {fast:.4f}, "
            f"gate {'passes' if r['gate_passes'] else 'fails'}"
        )


def _figure(results: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from common import RESULTS_DIR

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    families = list(results)
    for ax, key, title in (
        (axes[0], "max_abs_logprob_error", "max |logprob error| vs fp32"),
        (axes[1], "grad_relative_error", "adapter gradients' relative error vs fp32"),
    ):
        for j, path in enumerate(("bf16_base", "bf16_lora")):
            stats = [results[f]["summary"][path][key] for f in families]
            med = [s["median"] for s in stats]
            low = [s["median"] - s["min"] for s in stats]
            high = [s["max"] - s["median"] for s in stats]
            x = [i + (j - 0.5) * 0.35 for i in range(len(families))]
            ax.bar(x, med, 0.35, yerr=[low, high], capsize=3, label=path.replace("_", " "))
        ax.set_xticks(range(len(families)), families)
        ax.set_title(title)
        ax.legend()
    fig.suptitle("bf16 LoRA GEMMs vs the bf16 base path (median, min-max over seeds)")
    fig.tight_layout()
    fig.savefig(RESULTS_DIR / f"{NAME}.png", dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
