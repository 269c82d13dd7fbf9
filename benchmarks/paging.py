"""Paging cost: N tenants training through `--max-resident-models K` slots vs. the same run with
no limit, through the real SDK against a real `lockstep serve` (built-in tiny model).

Every tenant submits all its steps at once (pipelined). Measured per run: wall time, and on the
paged server every page-in (restore from snapshot + replay log; from the scheduler's log lines,
which carry the seconds each took) and the page in/out counters from /metrics. The final
adapters of both runs are compared (they must match: paging never changes numbers).

    python benchmarks/paging.py [--tenants 8] [--resident 2] [--steps 4] [--rank 16]
"""

from __future__ import annotations

import argparse
import re
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from common import (
    API_KEY,
    check,
    environment,
    figure_path,
    print_table,
    start_server,
    stop_server,
    write_json,
)
from tqdm import tqdm

NAME = "paging"
PAGE_IN = re.compile(r"model (\S+) paged in of the training engine in ([0-9.]+) s")


def _train(base_url: str, args: argparse.Namespace) -> tuple[float, list[str]]:
    import tinker
    from tinker import types

    from lockstep.demo import quickstart_data
    from lockstep.modeling.tiny import DEFAULT_MODEL_NAME

    client = tinker.ServiceClient(base_url=base_url, api_key=API_KEY)
    trainers = [
        client.create_lora_training_client(
            base_model=DEFAULT_MODEL_NAME, rank=args.rank, seed=i
        ).result()
        for i in range(args.tenants)
    ]
    data = quickstart_data(trainers[0].get_tokenizer())
    t0 = time.perf_counter()
    pending: list[Any] = []
    for step in range(args.steps):
        for i, t in enumerate(trainers):
            batch = [data[(i + step + k) % len(data)] for k in range(4)]
            pending.append(t.forward_backward(batch, "cross_entropy"))
            pending.append(t.optim_step(types.AdamParams(learning_rate=1e-2)))
    saves = [t.save_state("final") for t in trainers]
    for f in tqdm(pending, desc="requests", leave=False):
        f.result()
    paths = [s.result().path for s in saves]
    wall = time.perf_counter() - t0
    client.close("success").result()
    return wall, paths


def _adapter(data_dir: Path, path: str) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    (f,) = (data_dir / "checkpoints" / path.removeprefix("tinker://")).rglob(
        "adapter_model.safetensors"
    )
    return load_file(f)


def run(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="lockstep-paging-") as tmp:
        for label, extra in (
            ("unpaged", []),
            ("paged", ["--max-resident-models", str(args.resident)]),
        ):
            server = start_server(Path(tmp) / label, *extra, timeout=600)
            try:
                _train(server.base_url, argparse.Namespace(**{**vars(args), "steps": 1}))  # warm
                wall, paths = _train(server.base_url, args)
                log = server.log()
            finally:
                stop_server(server)
            out[label] = {"wall_s": wall, "paths": paths, "data_dir": Path(tmp) / label}
            out[label]["page_ins_s"] = [float(m.group(2)) for m in PAGE_IN.finditer(log)]
        worst = 0.0
        for a, b in zip(out["paged"]["paths"], out["unpaged"]["paths"], strict=True):
            x = _adapter(out["paged"]["data_dir"], a)
            y = _adapter(out["unpaged"]["data_dir"], b)
            worst = max(worst, max(float(np.abs(x[k] - y[k]).max()) for k in x))
    ins = out["paged"]["page_ins_s"]
    return {
        "name": NAME,
        "tenants": args.tenants,
        "resident": args.resident,
        "steps": args.steps,
        "rank": args.rank,
        "wall_s": {k: out[k]["wall_s"] for k in ("unpaged", "paged")},
        "slowdown": out["paged"]["wall_s"] / out["unpaged"]["wall_s"],
        "page_ins": len(ins),
        "page_in_s": {
            "median": statistics.median(ins) if ins else None,
            "p90": float(np.percentile(ins, 90)) if ins else None,
            "max": max(ins) if ins else None,
        },
        "page_in_samples_s": ins,
        "max_abs_adapter_diff": worst,
        "identical": worst <= 1e-5,
        "environment": environment(),
    }


def plot(result: dict[str, Any]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    ins = result["page_in_samples_s"]
    left.hist([1000 * s for s in ins], bins=20)
    left.set_xlabel("page-in latency (ms): snapshot load + replayed passes")
    left.set_ylabel("page-ins")
    left.set_title(
        f"{len(ins)} page-ins, median {1000 * (result['page_in_s']['median'] or 0):.1f} ms"
    )
    walls = result["wall_s"]
    right.bar(["no limit", f"{result['resident']} resident"], [walls["unpaged"], walls["paged"]])
    right.set_ylabel("wall time (s)")
    right.set_title(
        f"{result['tenants']} tenants x {result['steps']} steps: {result['slowdown']:.2f}x"
    )
    fig.tight_layout()
    path = figure_path(result["name"])
    fig.savefig(path, dpi=120)
    return path


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--tenants", type=int, default=8)
    p.add_argument("--resident", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    args = p.parse_args()
    result = run(args)
    path = write_json(NAME, result)
    fig = plot(result)
    print_table(
        "paging",
        ["metric", "value"],
        [
            ["wall no limit (s)", f"{result['wall_s']['unpaged']:.2f}"],
            [f"wall {args.resident} resident (s)", f"{result['wall_s']['paged']:.2f}"],
            ["page-ins", result["page_ins"]],
            ["page-in median (s)", f"{result['page_in_s']['median'] or 0:.4f}"],
            ["page-in p90 (s)", f"{result['page_in_s']['p90'] or 0:.4f}"],
            ["adapters identical", check(result["identical"])],
        ],
    )
    print(f"wrote {path} and {fig}")


if __name__ == "__main__":
    main()
