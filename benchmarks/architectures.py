"""The packed trainer path vs the generic path, per architecture, with mixed and uniform rows.

LocalTrainingEngine in-process (CPU, fp32) on each family's tiny model (lockstep/modeling/zoo.py).
One step = forward_backward over 2048 tokens + optim_step, one tenant (rank 8):

  uniform   16 rows of 128 tokens
  mixed     8 rows of 32..480 tokens (same 2048 tokens)

  packed    micro-batches of rows concatenated, per-row attention / linear-attention state
  generic   every row alone through the model's own forward (exact for any model, slower)

Engines of the two paths hold the same adapter and run interleaved rep by rep; every step's
loss must agree between them (asserted, fp32 1e-4 relative). Reported per family: tokens/s,
packed / generic, mixed / uniform (target >= 0.9, as for dense models).

    python benchmarks/architectures.py [--families ...] [--reps 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from common import check, environment, figure_path, print_table, write_json
from tqdm import tqdm

from lockstep.engine import families
from lockstep.engine.types import AdamConfig, Datum, LoraSpec, OptimRequest, PassRequest
from lockstep.modeling import zoo
from lockstep.modeling.architecture import TrainerPath
from lockstep.workers.local.trainer import LocalTrainingEngine

NAME = "architectures"
SHAPES = {"uniform": [128] * 16, "mixed": [480, 416, 352, 288, 224, 160, 96, 32]}
MIXED_TARGET = 0.9
ADAM = AdamConfig(learning_rate=1e-4)


def rows(lengths: list[int], seed: int) -> list[Datum]:
    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        t = rng.integers(5, 1000, size=n + 1)
        w = np.ones(n, np.float32)
        out.append(Datum(t[:-1].astype(np.int64), {"target_tokens": t[1:], "weights": w}))
    return out


def step(engine: LocalTrainingEngine, data: list[Datum]) -> tuple[float, float]:
    """(seconds, loss:sum) of one forward_backward + optim_step."""
    t0 = time.perf_counter()
    out = engine.run_passes([PassRequest("r", "t", "cross_entropy", {}, False, data)])
    engine.optim_step([OptimRequest("t", ADAM)])
    return time.perf_counter() - t0, out[0].metrics["loss:sum"]


def bench_family(family: str, cache: Path, reps: int) -> dict[str, Any]:
    directory = zoo.ensure_family(family, cache)
    model_type = str(zoo.FAMILIES[family]["model_type"])
    paths = [TrainerPath.GENERIC] + ([TrainerPath.PACKED] if model_type in families.PACKED else [])
    engines = {
        p: LocalTrainingEngine(directory, zoo.served_name(family), "cpu", trainer_path=p)
        for p in paths
    }
    for e in engines.values():
        e.create_model("t", LoraSpec(rank=8, alpha=16.0, seed=1))
    times: dict[str, list[float]] = {f"{p}/{s}": [] for p in paths for s in SHAPES}
    data = {s: rows(lengths, 7) for s, lengths in SHAPES.items()}
    for rep in range(reps + 1):  # rep 0 warms up
        for shape in SHAPES:
            losses = {}
            for p, e in engines.items():
                seconds, losses[p] = step(e, data[shape])
                if rep:
                    times[f"{p}/{shape}"].append(seconds)
            first = next(iter(losses.values()))
            assert all(abs(v - first) <= 1e-4 * abs(first) for v in losses.values()), losses
    for e in engines.values():
        e.close()
    tokens = sum(SHAPES["uniform"])
    result: dict[str, Any] = {"model_type": model_type, "tokens_per_step": tokens, "paths": {}}
    for key, ts in times.items():
        path, shape = key.split("/")
        tps = [tokens / t for t in ts]
        result["paths"].setdefault(path, {})[shape] = {
            "tokens_per_s_median": statistics.median(tps),
            "tokens_per_s_min": min(tps),
            "tokens_per_s_max": max(tps),
            "step_s": ts,
        }
    for path, shapes in result["paths"].items():
        per_rep = [
            u / m for u, m in zip(times[f"{path}/uniform"], times[f"{path}/mixed"], strict=True)
        ]
        shapes["mixed_over_uniform"] = _spread(per_rep)
    if TrainerPath.PACKED in paths:
        for shape in SHAPES:
            per_rep = [
                g / p
                for g, p in zip(times[f"generic/{shape}"], times[f"packed/{shape}"], strict=True)
            ]
            result[f"packed_over_generic_{shape}"] = _spread(per_rep)
    return result


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def plot(results: dict[str, dict[str, Any]]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fams = list(results)
    fig, ax = plt.subplots(figsize=(11, 4.5))
    width = 0.2
    for j, (route, shape) in enumerate(
        [("packed", "uniform"), ("packed", "mixed"), ("generic", "uniform"), ("generic", "mixed")]
    ):
        vals = [
            results[f]["paths"].get(route, {}).get(shape, {}).get("tokens_per_s_median", 0.0)
            for f in fams
        ]
        ax.bar(np.arange(len(fams)) + (j - 1.5) * width, vals, width, label=f"{route}, {shape}")
    ax.set_xticks(np.arange(len(fams)), fams, rotation=20)
    ax.set_ylabel("tokens/s (forward_backward + optim_step)")
    ax.set_title("Trainer paths per architecture (tiny models, CPU fp32, 2048 tokens/step)")
    ax.legend()
    fig.tight_layout()
    path = figure_path(NAME)
    fig.savefig(path, dpi=110)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="*", default=sorted(zoo.FAMILIES))
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    results = {}
    with tempfile.TemporaryDirectory(prefix="lockstep-zoo-") as cache:
        for family in tqdm(args.families, desc="families"):
            results[family] = bench_family(family, Path(cache), args.reps)
    table = []
    for fam, r in results.items():
        for path, shapes in r["paths"].items():
            mix = shapes["mixed_over_uniform"]
            table.append(
                [
                    fam,
                    path,
                    shapes["uniform"]["tokens_per_s_median"],
                    shapes["mixed"]["tokens_per_s_median"],
                    f"{mix['median']:.2f} ({mix['min']:.2f}-{mix['max']:.2f}) "
                    + (check(mix["median"] >= MIXED_TARGET) if path == "packed" else ""),
                    (
                        f"{r['packed_over_generic_uniform']['median']:.2f} / "
                        f"{r['packed_over_generic_mixed']['median']:.2f}"
                        if path == "packed"
                        else "-"
                    ),
                ]
            )
    print_table(
        f"Packed vs generic trainer path ({args.reps} reps; median (min-max))",
        ["family", "path", "uniform tok/s", "mixed tok/s", "mixed/uniform", "packed/generic u/m"],
        table,
    )
    write_json(NAME, {"environment": environment(), "reps": args.reps, "families": results})
    print("wrote", plot(results))


if __name__ == "__main__":
    main()
