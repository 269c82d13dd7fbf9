"""Memory over a long run: does anything grow with the steps taken?

Twelve tenants train through the real tinker SDK against one `lockstep serve` it starts: SFT
tenants (pipelined forward_backward + optim_step on 64-token datums) and RL tenants (each step:
`save_weights_and_get_sampling_client`, a group of samples, an importance-sampling step on
them, the way an RL loop makes a new sampling session per step), each at a steady pace
(`--sft-rate`, `--rl-rate`: what the retention holds is rate x retention, so a steady load
keeps it put however the machine's speed changes). Every `--period` seconds it
records the steps taken so far, Redis's used memory (INFO) and its keys, the bytes under the
data directory (by part: Redis's files, snapshots, checkpoints) and the RSS of every server
process. The server runs with short retention (`--future-ttl`, `--trace-retention`,
`--sampler-expiry`: seconds, not days) so the run reaches the steady state a real server reaches
after its retention: what a long-lived tenant leaves per step must expire or be compacted.

After warm-up (the first `--warmup` of the steps, and at least twice the retention) each
series' growth is the least-squares slope per 1,000 steps over its mean (a sawtooth, like the
append-only file between rewrites, fits flat); the goal is < 5 % per 1,000 steps for each.
These are byte counts: the machine's load changes how long the run takes, not what it measures.

    python benchmarks/soak_memory.py [--sft 8] [--rl 4] [--steps 6000] [--retention 30]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import psutil
import redis
from common import (
    API_KEY,
    check,
    environment,
    figure_path,
    print_table,
    server_processes,
    start_server,
    stop_server,
    write_json,
)
from tqdm import tqdm

if TYPE_CHECKING:
    from tinker.types import TensorData

NAME = "soak_memory"
BASE_MODEL = "Lockstep/tiny-qwen3"
GOAL = 0.05  # growth per 1,000 steps after warm-up, of each series
TOKENS = 64
GROUP = 4  # samples per RL step
SAMPLE_TOKENS = 16


class Tally:
    """Steps taken by all tenants; every tenant runs until together they took `target`."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.t0 = time.monotonic()
        self.done = threading.Event()
        self.steps = 0
        self.sampled = 0
        self.errors: list[str] = []
        self.lock = threading.Lock()

    def step(self, samples: int = 0) -> None:
        with self.lock:
            self.steps += 1
            self.sampled += samples
            if self.steps >= self.target:
                self.done.set()

    def pace(self, k: int, per_s: float) -> None:
        """Hold step `k` of a tenant stepping `per_s` times a second until its time: a steady
        load, so what the retention holds (rate x retention) stays put while the box's speed
        changes (what is retained for a time, not per step, would otherwise follow the speed)."""
        wait = self.t0 + k / per_s - time.monotonic()
        if wait > 0:
            self.done.wait(wait)

    def error(self, who: str, exc: BaseException) -> None:
        with self.lock:
            self.errors.append(f"{who}: {type(exc).__name__}: {exc}"[:500])


def tensor(values: list[int] | list[float], dtype: type = np.float32) -> TensorData:
    """A loss_fn_inputs array as the SDK makes one from a list (int64 tokens, float32 else)."""
    from tinker import types

    return types.TensorData.from_numpy(np.asarray(values, dtype))


def sft(i: int, base_url: str, tally: Tally, per_s: float) -> None:
    import tinker
    from tinker import types

    rng = np.random.default_rng(i)
    service = tinker.ServiceClient(base_url=base_url, api_key=API_KEY)
    trainer = service.create_lora_training_client(base_model=BASE_MODEL, rank=8, seed=i).result()
    adam = types.AdamParams(learning_rate=1e-4)
    prev, k = None, 0
    while not tally.done.is_set():
        tally.pace(k, per_s)
        k += 1
        ids = rng.integers(1, 1000, TOKENS + 1).tolist()
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(ids[:-1]),
            loss_fn_inputs={
                "target_tokens": tensor(ids[1:], np.int64),
                "weights": tensor([1.0] * TOKENS),
            },
        )
        futures = (trainer.forward_backward([datum], "cross_entropy"), trainer.optim_step(adam))
        if prev is not None:  # pipelined: step k is submitted before step k-1 is read
            prev[0].result()
            prev[1].result()
            tally.step()
        prev = futures
    if prev is not None:
        prev[0].result()
        prev[1].result()
        tally.step()


def rl(i: int, base_url: str, tally: Tally, per_s: float) -> None:
    import tinker
    from tinker import types

    rng = np.random.default_rng(100 + i)
    service = tinker.ServiceClient(base_url=base_url, api_key=API_KEY)
    trainer = service.create_lora_training_client(base_model=BASE_MODEL, rank=8, seed=i).result()
    adam = types.AdamParams(learning_rate=1e-4)
    params = types.SamplingParams(max_tokens=SAMPLE_TOKENS, temperature=1.0)
    k = 0
    while not tally.done.is_set():
        tally.pace(k, per_s)
        k += 1
        sampler = trainer.save_weights_and_get_sampling_client().result()
        prompt = rng.integers(1, 1000, 16).tolist()
        out = sampler.sample(types.ModelInput.from_ints(prompt), GROUP, params).result()
        rewards = [float(np.mean([t % 2 for t in s.tokens])) for s in out.sequences]
        baseline = float(np.mean(rewards))
        data = []
        for seq, reward in zip(out.sequences, rewards, strict=True):
            tokens, n = list(seq.tokens), len(seq.tokens)
            full = prompt + tokens
            data.append(
                types.Datum(
                    model_input=types.ModelInput.from_ints(full[:-1]),
                    loss_fn_inputs={
                        "target_tokens": tensor(full[1:], np.int64),
                        "logprobs": tensor(
                            [0.0] * (len(prompt) - 1) + list(seq.logprobs or [0.0] * n)
                        ),
                        "advantages": tensor([0.0] * (len(prompt) - 1) + [reward - baseline] * n),
                    },
                )
            )
        trainer.forward_backward(data, "importance_sampling").result()
        trainer.optim_step(adam).result()
        tally.step(len(out.sequences))


def run_tenant(fn: Callable[..., None], i: int, url: str, t: Tally, per_s: float) -> None:
    try:
        fn(i, url, t, per_s)
    except BaseException as exc:  # counted: the run must see none
        t.error(f"{fn.__name__} {i}", exc)
        traceback.print_exc()


def dir_bytes(root: Path) -> dict[str, int]:
    """Bytes under the data directory, by part."""
    parts = {"redis": 0, "state": 0, "checkpoints": 0, "other": 0}
    for dirpath, _, files in os.walk(root):
        rel = Path(dirpath).relative_to(root).parts
        part = rel[0] if rel and rel[0] in parts else "other"
        for f in files:
            try:
                parts[part] += os.stat(os.path.join(dirpath, f)).st_size
            except OSError:  # renamed or pruned meanwhile
                pass
    return parts


def sample(server: Any, r: redis.Redis, tally: Tally, t0: float) -> dict[str, Any]:
    info = r.info("memory")
    rss: dict[str, float] = {}
    for role, proc in server_processes(server.proc.pid):
        try:
            rss[role] = rss.get(role, 0.0) + proc.memory_info().rss
        except psutil.Error:
            continue
    disk = dir_bytes(server.data_dir)
    return {
        "t": round(time.monotonic() - t0, 2),
        "steps": tally.steps,
        "samples": tally.sampled,
        "redis_used_bytes": int(info["used_memory"]),
        "redis_keys": int(r.dbsize()),
        "data_dir_bytes": sum(disk.values()),
        "data_dir_by_part": disk,
        "rss_bytes": {k: int(v) for k, v in rss.items()},
    }


def growth(points: list[dict[str, Any]], value: Callable[[dict[str, Any]], float]) -> float:
    """Least-squares slope of `value` per 1,000 steps, over its mean."""
    steps = np.array([p["steps"] for p in points], dtype=float)
    values = np.array([value(p) for p in points], dtype=float)
    if len(points) < 3 or np.ptp(steps) == 0 or values.mean() == 0:
        return float("nan")
    slope = np.polyfit(steps, values, 1)[0]
    return float(slope * 1000 / values.mean())


def rss_of(role: str) -> Callable[[dict[str, Any]], float]:
    return lambda p: float(p["rss_bytes"].get(role, 0))


def summarize(a: argparse.Namespace, points: list[dict[str, Any]]) -> dict[str, Any]:
    total = points[-1]["steps"]
    warm_steps = a.warmup * total
    warm_t = 2 * a.retention
    after = [p for p in points if p["steps"] >= warm_steps and p["t"] >= warm_t]
    series: dict[str, Callable[[dict[str, Any]], float]] = {
        "redis_used_bytes": lambda p: p["redis_used_bytes"],
        "redis_keys": lambda p: p["redis_keys"],
        "data_dir_bytes": lambda p: p["data_dir_bytes"],
    }
    for role in sorted({k for p in points for k in p["rss_bytes"]}):
        series[f"rss_{role}_bytes"] = rss_of(role)
    rates = {name: growth(after, fn) for name, fn in series.items()}
    sizing = None
    if len(after) >= 2 and after[-1]["t"] > after[0]["t"]:
        per_s = (after[-1]["steps"] - after[0]["steps"]) / (after[-1]["t"] - after[0]["t"])
        base = points[0]["redis_used_bytes"]  # an empty server's
        held = float(np.mean([p["redis_used_bytes"] - base for p in after]))
        sizing = {
            "steps_per_s": per_s,
            # what one step leaves in Redis while it is retained: steady memory over the steps
            # the retention window holds (docs/operations.md sizes Redis with it)
            "redis_bytes_per_retained_step": held / (per_s * a.retention) if per_s else None,
        }
    return {
        "steps": total,
        "samples": points[-1]["samples"],
        "elapsed_s": points[-1]["t"],
        "warmup_until_steps": after[0]["steps"] if after else None,
        "points_after_warmup": len(after),
        "growth_per_1000_steps": rates,
        "sizing": sizing,
        "met": {name: bool(rate < GOAL) for name, rate in rates.items()},
        "after_warmup": {
            name: {"first": fn(after[0]), "last": fn(after[-1]), "max": max(map(fn, after))}
            for name, fn in series.items()
        }
        if after
        else {},
    }


def plot(a: argparse.Namespace, points: list[dict[str, Any]], summary: dict[str, Any]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [p["steps"] for p in points]
    mib = 1 / 2**20
    fig, (red, disk, mem) = plt.subplots(3, 1, figsize=(10, 11), sharex=True)
    red.plot(steps, [p["redis_used_bytes"] * mib for p in points], label="Redis used memory")
    keys = red.twinx()
    keys.plot(steps, [p["redis_keys"] for p in points], color="tab:orange", label="keys")
    keys.set_ylabel("keys")
    red.set_ylabel("MiB")
    red.legend(loc="upper left")
    keys.legend(loc="upper right")
    rates = summary["growth_per_1000_steps"]
    red.set_title(
        f"{a.sft} SFT + {a.rl} RL tenants, retention {a.retention:.0f} s: growth per 1,000 steps "
        f"after warm-up: Redis {rates['redis_used_bytes']:+.1%}, "
        f"data dir {rates['data_dir_bytes']:+.1%}"
    )
    for part in ("redis", "state", "checkpoints", "other"):
        disk.plot(steps, [p["data_dir_by_part"][part] * mib for p in points], label=part)
    disk.plot(
        steps, [p["data_dir_bytes"] * mib for p in points], color="black", lw=2, label="total"
    )
    disk.set_ylabel("data directory (MiB)")
    disk.legend(loc="upper left", fontsize=8)
    for role in sorted({k for p in points for k in p["rss_bytes"]}):
        mem.plot(steps, [p["rss_bytes"].get(role, 0) * mib for p in points], label=role)
    mem.set_ylabel("RSS (MiB)")
    mem.set_xlabel("steps taken (all tenants)")
    mem.legend(loc="upper left", fontsize=8)
    warm = summary["warmup_until_steps"]
    for ax in (red, disk, mem):
        if warm is not None:
            ax.axvline(warm, color="grey", linestyle=":")
    fig.tight_layout()
    path = figure_path(a.name)
    fig.savefig(path, dpi=110)
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sft", type=int, default=8, help="SFT tenants")
    p.add_argument("--rl", type=int, default=4, help="RL tenants (sampling every step)")
    p.add_argument("--steps", type=int, default=6000, help="steps of all tenants together")
    p.add_argument("--sft-rate", type=float, default=2.0, help="steps/s of each SFT tenant")
    p.add_argument("--rl-rate", type=float, default=0.5, help="steps/s of each RL tenant")
    p.add_argument(
        "--retention",
        type=float,
        default=30.0,
        help="seconds for --future-ttl, --trace-retention and --sampler-expiry",
    )
    p.add_argument("--warmup", type=float, default=0.3, help="fraction of the steps")
    p.add_argument("--period", type=float, default=2.0, help="seconds between samples")
    # The append-only file is compacted once past an eighth of the limit and doubled: a small
    # limit shows that sawtooth within minutes (it has the same bound at any size).
    p.add_argument("--redis-maxmemory-mb", type=int, default=64)
    p.add_argument("--name", default=NAME)
    a = p.parse_args()

    data_dir = Path(tempfile.mkdtemp(prefix="lockstep-soak-")) / "data"
    retention = str(int(a.retention))
    server = start_server(
        data_dir,
        "--future-ttl",
        retention,
        "--trace-retention",
        retention,
        "--sampler-expiry",
        retention,
        "--redis-maxmemory-mb",
        str(a.redis_maxmemory_mb),
    )
    r = redis.Redis.from_url((data_dir / "redis" / "url").read_text())
    tally = Tally(a.steps)
    points: list[dict[str, Any]] = []
    total = a.steps
    try:
        t0 = tally.t0 = time.monotonic()
        threads = [
            threading.Thread(target=run_tenant, args=(fn, i, server.base_url, tally, rate))
            for fn, n, rate in ((sft, a.sft, a.sft_rate), (rl, a.rl, a.rl_rate))
            for i in range(n)
        ]
        for t in threads:
            t.start()
        with tqdm(total=total, unit="step", desc=f"{a.sft} SFT + {a.rl} RL") as bar:
            while any(t.is_alive() for t in threads):
                points.append(sample(server, r, tally, t0))
                bar.n = tally.steps
                bar.set_postfix(
                    redis_mib=points[-1]["redis_used_bytes"] >> 20,
                    disk_mib=points[-1]["data_dir_bytes"] >> 20,
                    errors=len(tally.errors),
                )
                time.sleep(a.period)
        points.append(sample(server, r, tally, t0))
    finally:
        code = stop_server(server)
    summary = summarize(a, points)
    summary["errors"] = len(tally.errors)
    summary["server_exit_code"] = code
    png = plot(a, points, summary)
    path = write_json(
        a.name,
        {
            "config": vars(a),
            "environment": environment(),
            "summary": summary,
            "errors": tally.errors[:50],
            "points": points,
        },
    )
    seen = summary["after_warmup"]
    rows: list[tuple[object, ...]] = [
        (
            name,
            f"{seen[name]['first']:.4g} -> {seen[name]['last']:.4g}" if name in seen else "-",
            f"{rate:+.2%}",
            check(summary["met"][name]),
        )
        for name, rate in summary["growth_per_1000_steps"].items()
    ]
    rows.append(("errors", summary["errors"], "", check(summary["errors"] == 0)))
    print_table(
        f"soak: {summary['steps']} steps, {summary['samples']} samples, "
        f"{summary['elapsed_s']:.0f} s",
        ["series", "after warm-up (first -> last)", "growth / 1,000 steps", f"< {GOAL:.0%}"],
        rows,
    )
    print(f"wrote {path} and {png}")


if __name__ == "__main__":
    main()
