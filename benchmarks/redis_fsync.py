"""What `appendfsync always` costs against `everysec` for the scheduler's Redis writes.

Starts the embedded Redis binary (the one `lockstep serve` runs) twice on a data directory on the
same filesystem as the service's (--dir, default a temp dir), once per policy, and times the write
the clock makes once per finished request: a MULTI/EXEC that stores the result (a ~2 KB reply),
drops the payload, sets a TTL, takes the request off its model's queue and advances the model's
progress (the shape of Store.finish_job). Two loads:

  serial      one client, one transaction at a time (the clock's own pattern within a cycle)
  concurrent  16 clients at once (a busy gateway's submits and a cycle's writes together)

and reports per-transaction latency (p50, p99) and transactions per second, and the ratio
always / everysec. A training step of the tiny model takes tens to hundreds of milliseconds and
writes a handful of such transactions, so the cost that matters is a few fsyncs per step.

    python benchmarks/redis_fsync.py [--n 2000] [--dir PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import redis
import redis.asyncio as aioredis
from common import environment, figure_path, print_table, write_json
from tqdm import tqdm

from lockstep.ports import free_port
from lockstep.supervisor import redis_binary

NAME = "redis_fsync"
POLICIES = ("everysec", "always")
CONCURRENCY = 16
RESULT = b"x" * 2048


def start(directory: Path, policy: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    proc = subprocess.Popen(
        [
            redis_binary(),
            *("--bind", "127.0.0.1", "--port", str(port), "--dir", str(directory)),
            *("--appendonly", "yes", "--appendfsync", policy, "--save", ""),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    for _ in range(200):
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    return proc, url


async def finish(client: aioredis.Redis, i: int) -> float:
    started = time.perf_counter()
    async with client.pipeline(transaction=True) as pipe:
        pipe.hset(f"job:{i}", mapping={"status": "done", "result": RESULT})
        pipe.hdel(f"job:{i}", "payload")
        pipe.expire(f"job:{i}", 3600)
        pipe.zrem("pending:m", f"job:{i}")
        pipe.hset("progress:m", mapping={"next_seq": i + 1, "last_request_time": time.time()})
        await pipe.execute()
    return time.perf_counter() - started


async def measure(url: str, n: int, concurrency: int, bar: tqdm) -> dict[str, float]:
    client = aioredis.Redis.from_url(url, max_connections=concurrency)
    latencies: list[float] = []

    async def worker(offset: int) -> None:
        for i in range(offset, n, concurrency):
            latencies.append(await finish(client, i))
            bar.update()

    started = time.perf_counter()
    await asyncio.gather(*(worker(k) for k in range(concurrency)))
    wall = time.perf_counter() - started
    await client.aclose()
    latencies.sort()
    return {
        "p50_ms": 1e3 * statistics.median(latencies),
        "p99_ms": 1e3 * latencies[int(0.99 * (len(latencies) - 1))],
        "tx_per_s": n / wall,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=2000, help="transactions per policy and load")
    p.add_argument("--dir", type=Path, default=None, help="where the AOF goes (its filesystem)")
    args = p.parse_args()
    results: dict[str, dict[str, dict[str, float]]] = {}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        with tqdm(total=len(POLICIES) * 2 * args.n, desc="transactions") as bar:
            for policy in POLICIES:
                directory = Path(tmp) / policy
                directory.mkdir()
                proc, url = start(directory, policy)
                try:
                    results[policy] = {
                        "serial": asyncio.run(measure(url, args.n, 1, bar)),
                        "concurrent": asyncio.run(measure(url, args.n, CONCURRENCY, bar)),
                    }
                finally:
                    proc.terminate()
                    proc.wait(10)
    ratios = {
        load: {
            "p50": results["always"][load]["p50_ms"] / results["everysec"][load]["p50_ms"],
            "tx_per_s": results["always"][load]["tx_per_s"] / results["everysec"][load]["tx_per_s"],
        }
        for load in ("serial", "concurrent")
    }
    rows: list[list[Any]] = [
        [policy, load, r["p50_ms"], r["p99_ms"], r["tx_per_s"]]
        for policy, loads in results.items()
        for load, r in loads.items()
    ]
    print_table(
        "scheduler write (finish_job-shaped MULTI/EXEC)",
        ["appendfsync", "load", "p50 ms", "p99 ms", "tx/s"],
        rows,
    )
    print(f"always / everysec: {ratios}")
    write_json(
        NAME,
        {"environment": environment(), "n": args.n, "results": results, "ratios": ratios},
    )
    plot(results)


def plot(results: dict[str, dict[str, dict[str, float]]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    loads = ("serial", "concurrent")
    for ax, metric, label in (
        (axes[0], "p50_ms", "p50 latency per transaction (ms)"),
        (axes[1], "tx_per_s", "transactions per second"),
    ):
        width = 0.38
        for k, policy in enumerate(POLICIES):
            values = [results[policy][load][metric] for load in loads]
            ax.bar([i + k * width for i in range(len(loads))], values, width, label=policy)
        ax.set_xticks([i + width / 2 for i in range(len(loads))], loads)
        ax.set_title(label, fontsize=10)
    axes[0].legend(title="appendfsync")
    fig.suptitle("Redis appendfsync: the scheduler's finish_job-shaped write", fontsize=11)
    fig.tight_layout()
    fig.savefig(figure_path(NAME), dpi=120)


if __name__ == "__main__":
    main()
