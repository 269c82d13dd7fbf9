"""Mixture-of-experts training cost: expert LoRA, multi-tenant packing, routing skew.

LocalTrainingEngine in-process (CPU, fp32). Models: the zoo's tiny Qwen3-MoE (hidden 64, 8
experts, top-2) and a SmolLM2-width Qwen3-MoE built at random (hidden 576, 9 heads / 3 KV heads,
8 of SmolLM2's 30 layers, 8 experts of 384 = a quarter of SmolLM2's 1536 MLP, top-2; the
built-in 1024-token vocabulary). A step = forward_backward + optim_step.

  targets   one tenant, 1024 tokens: LoRA on the head only (no gradient reaches the layers:
            a forward pass plus the head's backward), attention only, and the default
            (attention + every expert's w1/w3/w2 + head); experts / attention is the price of
            training the experts
  packing   K = 1, 4, 8 tenants x 2 rows x 128 tokens in ONE run_passes vs ONE tenant sending
            all K x 2 rows (target >= 0.9: packing costs little over the same tokens alone)
  skew      the default adapter with the model's random routers (roughly even expert load) vs
            routers zeroed (every token to the same 2 experts); the busiest expert's share

Modes run interleaved rep by rep; packed and alone losses must match (asserted).

    python benchmarks/moe.py [--models tiny smol] [--reps 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from common import check, environment, figure_path, print_table, write_json
from tqdm import tqdm

from lockstep.engine.types import AdamConfig, Datum, LoraSpec, OptimRequest, PassRequest
from lockstep.modeling import zoo
from lockstep.workers.local.trainer import LocalTrainingEngine

NAME = "moe"
PACKING_TARGET = 0.9
ADAM = AdamConfig(learning_rate=1e-4)
SMOL = {
    "model_type": "qwen3_moe",
    "hidden_size": 576,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "num_hidden_layers": 8,
    "intermediate_size": 1536,
    "moe_intermediate_size": 384,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
}
TARGETS = {
    "head only": LoraSpec(rank=16, alpha=32.0, seed=1, train_attn=False, train_mlp=False),
    "attention": LoraSpec(rank=16, alpha=32.0, seed=1, train_mlp=False, train_unembed=False),
    "attention + experts": LoraSpec(rank=16, alpha=32.0, seed=1),
}


def rows(n: int, length: int, seed: int) -> list[Datum]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        t = rng.integers(5, 1000, size=length + 1)
        w = np.ones(length, np.float32)
        out.append(Datum(t[:-1].astype(np.int64), {"target_tokens": t[1:], "weights": w}))
    return out


def step(engine: LocalTrainingEngine, work: dict[str, list[Datum]]) -> tuple[float, list[float]]:
    """(seconds, losses) of one run_passes over every tenant's rows + one optim_step."""
    t0 = time.perf_counter()
    out = engine.run_passes(
        [PassRequest(m, m, "cross_entropy", {}, False, data) for m, data in work.items()]
    )
    engine.optim_step([OptimRequest(m, ADAM) for m in work])
    return time.perf_counter() - t0, [o.metrics["loss:sum"] for o in out]


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def timed(engine: LocalTrainingEngine, work: dict[str, list[Datum]]) -> Callable[[], float]:
    """A mode for `interleaved`: one step of `work`; its seconds."""
    return lambda: step(engine, work)[0]


def interleaved(modes: dict[str, Callable[[], float]], reps: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {m: [] for m in modes}
    for rep in range(reps + 1):  # rep 0 warms up
        for mode, run in modes.items():
            seconds = run()
            if rep:
                times[mode].append(seconds)
    return times


def bench_targets(engine: LocalTrainingEngine, reps: int) -> dict[str, Any]:
    data = rows(8, 128, 1)
    for label, spec in TARGETS.items():
        engine.create_model(label, spec)
    times = interleaved({m: timed(engine, {m: data}) for m in TARGETS}, reps)
    attn = times["attention"]
    return {
        m: {
            "tokens_per_s": spread([1024 / t for t in ts]),
            "time_over_attention_only": spread([t / b for t, b in zip(ts, attn, strict=True)]),
        }
        for m, ts in times.items()
    }


def bench_packing(engine: LocalTrainingEngine, reps: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k in (1, 4, 8):
        data = {f"p{k}-{i}": rows(2, 128, 100 + i) for i in range(k)}
        for i, m in enumerate(data):
            engine.create_model(m, LoraSpec(rank=(8, 16, 32)[i % 3], alpha=32.0, seed=i))
        alone = f"one{k}"
        engine.create_model(alone, LoraSpec(rank=16, alpha=32.0, seed=99))
        together = [d for rows_ in data.values() for d in rows_]
        times = interleaved(
            {
                "packed": timed(engine, data),
                "one tenant": timed(engine, {alone: together}),
            },
            reps,
        )
        out[f"K={k}"] = {
            "tokens": 256 * k,
            "packed_tokens_per_s": spread([256 * k / t for t in times["packed"]]),
            "one_tenant_tokens_per_s": spread([256 * k / t for t in times["one tenant"]]),
            "packed_over_one_tenant": spread(
                [o / p for o, p in zip(times["one tenant"], times["packed"], strict=True)]
            ),
        }
        # Numbers never depend on who else is in the cycle: tenant 0 alone == packed.
        first = next(iter(data))
        alone_loss = forward_losses(engine, {first: data[first]})[0]
        packed_loss = forward_losses(engine, data)[0]
        assert abs(alone_loss - packed_loss) <= 1e-5 * abs(alone_loss), (alone_loss, packed_loss)
    return out


def forward_losses(engine: LocalTrainingEngine, work: dict[str, list[Datum]]) -> list[float]:
    out = engine.run_passes(
        [PassRequest(m, m, "cross_entropy", {}, True, data) for m, data in work.items()]
    )
    return [o.metrics["loss:sum"] for o in out]


def expert_load(engine: LocalTrainingEngine, data: list[Datum]) -> float:
    """The busiest expert's share of routed (token, expert) pairs in one forward."""
    counts: list[torch.Tensor] = []
    hooks = [
        module.register_forward_hook(lambda _m, _i, out: counts.append(out[2].flatten()))
        for name, module in engine._model.named_modules()
        if name.endswith("mlp.gate")
    ]
    engine.run_passes([PassRequest("x", "skew", "cross_entropy", {}, True, data)])
    for h in hooks:
        h.remove()
    loads = torch.bincount(torch.cat(counts))
    return float(loads.max() / loads.sum())


def bench_skew(directory: Path, name: str, reps: int) -> dict[str, Any]:
    data = rows(8, 128, 3)
    engines = {}
    for label in ("balanced", "all to 2 experts"):
        engine = LocalTrainingEngine(directory, name, "cpu")
        if label != "balanced":
            with torch.no_grad():
                for mod_name, module in engine._model.named_modules():
                    if mod_name.endswith("mlp.gate"):
                        module.weight.zero_()  # equal logits: top-k takes the same experts
        engine.create_model("skew", TARGETS["attention + experts"])
        engines[label] = engine
    loads = {label: expert_load(e, data) for label, e in engines.items()}
    times = interleaved({m: timed(e, {"skew": data}) for m, e in engines.items()}, reps)
    for e in engines.values():
        e.close()
    return {
        m: {"tokens_per_s": spread([1024 / t for t in ts]), "busiest_expert_share": loads[m]}
        for m, ts in times.items()
    }


def bench_model(directory: Path, name: str, reps: int) -> dict[str, Any]:
    engine = LocalTrainingEngine(directory, name, "cpu")
    try:
        result = {"targets": bench_targets(engine, reps), "packing": bench_packing(engine, reps)}
    finally:
        engine.close()
    result["skew"] = bench_skew(directory, name, reps)
    return result


def plot(results: dict[str, dict[str, Any]]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 3, figsize=(13, 3.6 * len(results)), squeeze=False)
    for row, (model, r) in enumerate(results.items()):
        ax = axes[row][0]
        labels = list(r["targets"])
        ax.bar(labels, [r["targets"][m]["tokens_per_s"]["median"] for m in labels])
        ax.set_title(f"{model}: LoRA targets (1 tenant)")
        ax.set_ylabel("tokens/s")
        ax.tick_params(axis="x", labelsize=8)
        ax = axes[row][1]
        ks = list(r["packing"])
        x = np.arange(len(ks))
        for j, key in enumerate(("packed_tokens_per_s", "one_tenant_tokens_per_s")):
            vals = [r["packing"][k][key]["median"] for k in ks]
            ax.bar(x + (j - 0.5) * 0.35, vals, 0.35, label=key.replace("_tokens_per_s", ""))
        ax.set_xticks(x, ks)
        ax.set_title(f"{model}: K tenants packed vs one tenant")
        ax.legend(fontsize=8)
        ax = axes[row][2]
        labels = list(r["skew"])
        ax.bar(labels, [r["skew"][m]["tokens_per_s"]["median"] for m in labels])
        ax.set_title(f"{model}: routing skew")
    fig.tight_layout()
    path = figure_path(NAME)
    fig.savefig(path, dpi=100)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=["tiny", "smol"], choices=["tiny", "smol"])
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="lockstep-moe-") as cache:
        for model in tqdm(args.models, desc="models"):
            directory = (
                zoo.ensure_family("qwen3_moe", Path(cache))
                if model == "tiny"
                else zoo.ensure_model("smol-moe", SMOL, Path(cache))
            )
            results[model] = bench_model(directory, f"Lockstep/{model}-moe", args.reps)
    _report(results, args.reps)
    write_json(
        NAME, {"environment": environment(), "reps": args.reps, "smol_config": SMOL, **results}
    )
    print("wrote", plot(results))


def _fmt(s: dict[str, float], digits: int = 2) -> str:
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"


def _report(results: dict[str, Any], reps: int) -> None:
    for model, r in results.items():
        print_table(
            f"{model}: LoRA targets, one tenant, 1024 tokens ({reps} reps; median (min-max))",
            ["targets", "tokens/s", "time / attention only"],
            [
                [m, _fmt(v["tokens_per_s"], 0), _fmt(v["time_over_attention_only"])]
                for m, v in r["targets"].items()
            ],
        )
        print_table(
            f"{model}: K tenants packed vs one tenant with the same tokens",
            ["K", "packed tok/s", "one tenant tok/s", "packed / one tenant"],
            [
                [
                    k,
                    _fmt(v["packed_tokens_per_s"], 0),
                    _fmt(v["one_tenant_tokens_per_s"], 0),
                    _fmt(v["packed_over_one_tenant"])
                    + " "
                    + check(v["packed_over_one_tenant"]["median"] >= PACKING_TARGET),
                ]
                for k, v in r["packing"].items()
            ],
        )
        print_table(
            f"{model}: routing skew (default adapter, 1024 tokens)",
            ["routers", "tokens/s", "busiest expert share"],
            [
                [m, _fmt(v["tokens_per_s"], 0), v["busiest_expert_share"]]
                for m, v in r["skew"].items()
            ],
        )


if __name__ == "__main__":
    main()
