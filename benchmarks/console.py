"""Console pages with 100 training runs and 10,000 steps of history: server time per view.

A real `lockstep serve`: 100 LoRA training runs created through the real SDK (one key), then
10,000 optimizer steps of history written to one of them by the scheduler's own commit script
(`scheduler/state/commit.py`, a forward_backward and an optim_step per step, as a cycle commits
them; training 10,000 real steps on this CPU would take hours). Each console view is then
fetched over HTTP with the key, `--repeat` times, and timed from request to last byte: the
gateway's render plus every scheduler and Redis read behind it. Target: under 300 ms (p95).

    python benchmarks/console.py [--runs 100] [--steps 10000] [--repeat 20]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from common import (
    check,
    environment,
    figure_path,
    print_table,
    start_server,
    stop_server,
    write_json,
)
from tqdm import tqdm

NAME = "console"
TARGET_S = 0.300
KEY = "tml-console-benchmark"
ADMIN = "tml-console-benchmark-admin"


async def seed_history(redis_url: str, model_id: str, steps: int) -> None:
    """`steps` steps of committed history: a forward_backward and an optim_step each, through
    the commit script (each op claimed as pending first, as admission leaves it)."""
    from lockstep.scheduler.state import keys
    from lockstep.scheduler.state.commit import commit_ops
    from lockstep.scheduler.state.outcome import Outcome
    from lockstep.scheduler.state.records import QueuedOp
    from lockstep.scheduler.state.store import Store
    from lockstep.vocab import OpKind

    store = Store.from_url(redis_url)
    seq = 1_000_000  # past the run's own seq_ids
    batch = 250
    for first in tqdm(range(0, steps, batch), desc="history", unit="x250 steps"):
        pairs = []
        for step in range(first, min(first + batch, steps)):
            loss = 3.0 / (1 + step / 500) + 0.05 * ((step * 7919) % 13) / 13
            fb = QueuedOp(f"bench-{model_id}-{seq}", model_id, seq, OpKind.FORWARD_BACKWARD, 512)
            opt = QueuedOp(f"bench-{model_id}-{seq + 1}", model_id, seq + 1, OpKind.OPTIM_STEP)
            pairs.append((fb, Outcome(metrics={"loss:sum": loss * 512}, datums=8)))
            pairs.append((opt, Outcome(metrics={"grad_norm:mean": 1 + loss, "step:max": step})))
            seq += 2
        await store.redis.zadd(
            keys.pending(model_id), {op.request_id: op.seq_id for op, _ in pairs}
        )
        await commit_ops(store.redis, 3600, pairs)
    await store.close()


def timed(client: httpx.Client, path: str, key: str, repeat: int) -> dict[str, Any]:
    seconds, size = [], 0
    for _ in range(repeat):
        start = time.perf_counter()
        resp = client.get(path, headers={"X-API-Key": key})
        seconds.append(time.perf_counter() - start)
        assert resp.status_code == 200, (path, resp.status_code, resp.text[:300])
        size = len(resp.content)
    seconds.sort()
    return {
        "path": path,
        "p50_s": statistics.median(seconds),
        "p95_s": seconds[max(0, round(0.95 * len(seconds)) - 1)],
        "max_s": seconds[-1],
        "bytes": size,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    import tinker

    from lockstep.modeling.tiny import DEFAULT_MODEL_NAME

    with tempfile.TemporaryDirectory() as tmp:
        server = start_server(Path(tmp) / "data", "--admin-key", ADMIN)
        try:
            service = tinker.ServiceClient(base_url=server.base_url, api_key=KEY)
            runs = [
                service.create_lora_training_client(base_model=DEFAULT_MODEL_NAME, rank=1).result()
                for _ in tqdm(range(args.runs), desc="runs", unit="run")
            ]
            deep = runs[0].model_id
            redis_url = (server.data_dir / "redis" / "url").read_text().strip()
            asyncio.run(seed_history(redis_url, deep, args.steps))
            views = [
                ("shell (no data)", "/console", KEY),
                ("runs (100, the key's)", "/console/view/runs", KEY),
                ("runs (100, admin: every key's)", "/console/view/runs", ADMIN),
                (f"a run ({args.steps} steps)", f"/console/view/runs/{deep}", KEY),
                ("a run's live part", f"/console/view/runs/{deep}/live", KEY),
                ("usage (14 days)", "/console/view/usage", KEY),
                ("playground", "/console/view/playground", KEY),
                ("clock", "/console/view/clock", KEY),
                ("API: the run's history", f"/api/v1/training_runs/{deep}/history", KEY),
            ]
            with httpx.Client(base_url=server.base_url, timeout=60) as client:
                for _, path, key in views:  # warm: first renders load templates, codecs
                    timed(client, path, key, 2)
                results = [
                    {"view": name, **timed(client, path, key, args.repeat)}
                    for name, path, key in tqdm(views, desc="views", unit="view")
                ]
            history = client_history_steps(server.base_url, deep)
        finally:
            stop_server(server)
    pages = [r for r in results if not r["view"].startswith("API")]
    return {
        "name": NAME,
        "runs": args.runs,
        "steps": args.steps,
        "history_steps_served": history,
        "repeat": args.repeat,
        "target_s": TARGET_S,
        "views": results,
        "met": all(r["p95_s"] < TARGET_S for r in pages),
        "environment": environment(),
    }


def client_history_steps(base_url: str, model_id: str) -> int:
    with httpx.Client(base_url=base_url, timeout=60) as client:
        resp = client.get(f"/api/v1/training_runs/{model_id}/history", headers={"X-API-Key": KEY})
        return len(resp.json()["steps"])


def plot(result: dict[str, Any]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    views = result["views"]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    names = [v["view"] for v in views]
    ax.barh(names, [1000 * v["p95_s"] for v in views], color="#0b5fad", label="p95")
    ax.barh(names, [1000 * v["p50_s"] for v in views], color="#7fb2e5", label="p50")
    ax.axvline(1000 * TARGET_S, color="black", linestyle="--", label="target 300 ms")
    ax.invert_yaxis()
    ax.set_xlabel("server time per view, request to last byte (ms)")
    ax.set_title(f"Console views: {result['runs']} runs, {result['steps']} steps of history")
    ax.legend(loc="lower right")
    fig.tight_layout()
    path = figure_path(NAME)
    fig.savefig(path, dpi=110)
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--runs", type=int, default=100)
    p.add_argument("--steps", type=int, default=10_000)
    p.add_argument("--repeat", type=int, default=20)
    args = p.parse_args()
    result = run(args)
    assert result["history_steps_served"] == args.steps, result["history_steps_served"]
    print_table(
        f"console views ({args.runs} runs, {args.steps} steps)",
        ["view", "p50 ms", "p95 ms", "bytes", f"< {TARGET_S * 1000:.0f} ms"],
        [
            (
                v["view"],
                f"{1000 * v['p50_s']:.1f}",
                f"{1000 * v['p95_s']:.1f}",
                v["bytes"],
                check(v["p95_s"] < TARGET_S),
            )
            for v in result["views"]
        ],
    )
    print(write_json(NAME, result), plot(result))


if __name__ == "__main__":
    main()
