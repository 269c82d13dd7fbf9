"""Sync vs async RL wall time: the real tinker-cookbook `rl.train` on the parity bandit
(tests/cookbook/drivers/rl_bandit.py) against one real `lockstep serve`, the same number of steps
in each mode, one run at a time:

  sync        sample a batch -> train on it -> publish -> next batch (no overlap)
  async K=k   AsyncConfig(max_steps_off_policy=k, groups_per_batch=G): rollout workers keep
              sampling with the last published sampler while the clock trains

Reported per mode: wall time of the run, mean step time, final reward, the staleness of the groups
each step trained on (cookbook metrics sampling_client/step_*), and the async/sync wall ratio.
The cookbook venv is the tests' (tests/cookbook/conftest.py builds or reuses it).

    python benchmarks/async_rl.py [--steps 8] [--groups 4] [--group-size 8] [--max-tokens 8]
                                  [--off-policy 1 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import (
    REPO_ROOT,
    environment,
    figure_path,
    print_table,
    start_server,
    stop_server,
    write_json,
)
from tqdm import tqdm

sys.path.insert(0, str(REPO_ROOT))  # the cookbook harness lives with the tests
from tests.cookbook.conftest import Cookbook, ensure_cookbook_venv, read_jsonl  # noqa: E402

NAME = "async_rl"


def run_mode(
    cookbook: Cookbook, root: Path, label: str, k: int | None, args: Any
) -> dict[str, Any]:
    log_path = root / label
    config: dict[str, Any] = dict(
        model_name=str(cookbook.model_dir),
        base_url=cookbook.server.base_url,
        log_path=str(log_path),
        loss_fn="importance_sampling",
        learning_rate=1e-2,
        steps=args.steps,
        groups_per_batch=args.groups,
        group_size=args.group_size,
        max_tokens=args.max_tokens,
        save_every=0,
    )
    if k is not None:
        config["async_config"] = {"max_steps_off_policy": k, "groups_per_batch": args.groups}
    start = time.perf_counter()
    cookbook.driver("rl_bandit.py", root / f"{label}.log", **config).wait(timeout=3600)
    wall = time.perf_counter() - start
    rows = sorted(read_jsonl(log_path / "metrics.jsonl"), key=lambda r: r["step"])
    stale = [
        r["training_client/step"] - r["sampling_client/step_min"]
        for r in rows
        if "sampling_client/step_min" in r
    ]
    return {
        "mode": label,
        "max_steps_off_policy": k,
        "wall_s": wall,
        "step_s_mean": statistics.mean(r["time/total"] for r in rows),
        "reward": [r["env/all/reward/total"] for r in rows],
        "staleness": stale,
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from lockstep.modeling.tiny import ensure_default_model

    python = ensure_cookbook_venv()
    with tempfile.TemporaryDirectory(prefix="lockstep-async-rl-") as tmp:
        root = Path(tmp)
        model_dir = ensure_default_model(root / "models")
        server = start_server(root / "data", "--model", str(model_dir))
        home = root / "home"
        home.mkdir()
        try:
            cookbook = Cookbook(python, server, model_dir, home)
            modes: list[tuple[str, int | None]] = [("sync", None)]
            modes += [(f"async K={k}", k) for k in args.off_policy]
            runs = [
                run_mode(cookbook, root, label, k, args) for label, k in tqdm(modes, desc="runs")
            ]
        finally:
            stop_server(server)
    sync_wall = runs[0]["wall_s"]
    for r in runs:
        r["wall_vs_sync"] = r["wall_s"] / sync_wall
    return {
        "name": NAME,
        "steps": args.steps,
        "groups": args.groups,
        "group_size": args.group_size,
        "max_tokens": args.max_tokens,
        "runs": runs,
        "environment": environment(),
    }


def plot(result: dict[str, Any]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.bar([r["mode"] for r in runs], [r["wall_s"] for r in runs], color="tab:blue")
    for i, r in enumerate(runs):
        left.annotate(f"{r['wall_vs_sync']:.2f}x", (i, r["wall_s"]), ha="center", va="bottom")
    left.set_ylabel("wall time (s)")
    left.set_title(f"{result['steps']} steps, {result['groups']} groups x {result['group_size']}")
    for r in runs:
        right.plot(range(len(r["reward"])), r["reward"], marker="o", label=r["mode"])
    right.set_xlabel("step")
    right.set_ylabel("mean reward")
    right.set_title("parity bandit reward")
    right.legend()
    fig.tight_layout()
    path = figure_path(NAME)
    fig.savefig(path, dpi=120)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--off-policy", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    result = measure(args)
    print_table(
        "sync vs async rl.train",
        ["mode", "wall s", "vs sync", "step s", "final reward", "max staleness"],
        [
            [
                r["mode"],
                r["wall_s"],
                r["wall_vs_sync"],
                r["step_s_mean"],
                r["reward"][-1],
                max(r["staleness"], default=0),
            ]
            for r in result["runs"]
        ],
    )
    print(f"wrote {write_json(NAME, result)} and {plot(result)}")


if __name__ == "__main__":
    main()
