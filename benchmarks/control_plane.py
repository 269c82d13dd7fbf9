"""Control-plane cost: what SDK -> gateway -> gRPC -> Redis -> clock adds to a minimal request.

A real `lockstep serve` on the tiny model with the triggered clock and `--clock-gather 0` (no
gather window is counted), against the same engine calls made in-process (in a fresh process
set up as the server's engine processes are: ENGINE_ENV and their share of the cores):

  forward           a 1-token `forward` (rank-32 adapter) through the SDK vs `run_passes`
  forward_backward  the same datum's `forward_backward` (no optimizer step) vs `run_passes`
  sample            a 1-token `sample` of the base model through the SDK vs `sample`
  retrieve          `retrieve_future` of a future that has already finished (one HTTP call; the
                    in-process equivalent is nothing)

Per request: added latency p50/p99 (SDK p50/p99 minus the in-process p50), Redis commands per
request (INFO's total_commands_processed over the run, less the idle rate measured just before;
commands inside Lua scripts count) and Redis round trips per request (the scheduler's
lockstep_redis_round_trips_total over the run: one per command, pipeline or transaction sent).

Then the span profile (benchmarks/spans.py): n more forwards and samples, one at a time, with
both processes' /metrics scraped around each and the session trace read at the end; each
request's wall time is cut into SDK client / HTTP + gateway / gRPC hop / scheduler handler /
Redis / clock wait / engine compute (its in-process median) / engine idle wake (the in-process
call paced as the server's is, IDLE_BETWEEN_S apart, over back to back: an idle core's cold
caches and wake-up) / engine pipe / cycle other / future retrieval, and the per-part medians
are reported (`spans` in the JSON, stacked bars in
the PNG).

Last, 8 tenants run pipelined forward_backward + optim_step loops: the scheduler process's own
CPU time (its engines run in child processes) over the wall time. And each hop at its barest
(hop_floors.py: HTTP, gRPC and Redis round trips with nothing behind them), summed over a
request's path (PATH_HOPS): what no code behind the hops can take a request below.

    python benchmarks/control_plane.py [--n 60] [--steps 12]
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing as mp
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import hop_floors
import httpx
import numpy as np
import redis
import spans
import tinker
from common import (
    API_KEY,
    REPO_ROOT,
    Server,
    check,
    cpu_seconds_by_role,
    environment,
    figure_path,
    print_table,
    settle_client_heap,
    start_server,
    stop_server,
    write_json,
)
from tinker import types
from tqdm import tqdm

from lockstep.engine.types import (
    Datum,
    LoraSpec,
    PassRequest,
    SampleParams,
    SampleRequest,
)
from lockstep.modeling.tiny import ensure_default_model
from lockstep.ports import free_port
from lockstep.rollout.local.sampler import LocalSamplingEngine
from lockstep.workers.local.trainer import LocalTrainingEngine
from lockstep.workers.process import engine_env, share_cores

NAME = "control_plane"
MODEL = "Lockstep/tiny-qwen3"
# Issue #21: added latency per request kind, Redis per forward_backward, scheduler CPU share.
TARGETS = {
    "forward": {"added_p50_ms": 5.0, "added_p99_ms": 15.0},
    "sample": {"added_p50_ms": 4.0, "added_p99_ms": 12.0},
    "forward_backward": {"redis_round_trips": 6, "redis_commands": 12},
    "scheduler_cpu_share": 0.08,
}
PROFILED = {"forward": "trainer", "sample": "sampler"}  # request kind -> its engine
# The hops on a request's path, one after another: a forward's two HTTP calls (forward, then
# retrieve_future) and their two gRPC calls, the claim, the cycle's plan and commit; a sample's
# three HTTP calls (asample, the session poll's answer, retrieve_future answered by the gateway)
# over two gRPC calls, the claim and the sampling lane's read and answer.
PATH_HOPS = {
    "forward": {"http": 2, "grpc": 2, "redis": 3},
    "sample": {"http": 3, "grpc": 2, "redis": 3},
}
# The profiled calls are also timed in process with the engine idle this long between calls,
# about a request's wall time through the server: the server's engine idles so between them.
IDLE_BETWEEN_S = 0.015


# Full (generation 2) collections of this process's heap during timed requests: the server's
# processes settle their heaps (lockstep/runtime.py); this one holds the in-process engines too.
CLIENT_GC = {"full_collections": 0}


def _count_full_collections(phase: str, info: dict[str, int]) -> None:
    if phase == "start" and info["generation"] == 2:
        CLIENT_GC["full_collections"] += 1


def timed(fn: Callable[[], object], n: int, desc: str, idle_s: float = 0.0) -> list[float]:
    for _ in range(3):  # warm-up: first-call costs, connection set-up
        fn()
    out = []
    for _ in tqdm(range(n), desc=desc):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
        time.sleep(idle_s)
    return out


def direct(n: int) -> dict[str, list[float]]:
    """The engine calls in process, in a fresh process set up as the server's engine processes
    are (ENGINE_ENV, their share of the cores): the same engine, without the server around it."""
    with engine_env(), ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        return pool.submit(_direct, n).result()


def _direct(n: int) -> dict[str, list[float]]:
    share_cores()
    model_dir = ensure_default_model(Path.home() / ".cache" / "lockstep" / "models")
    trainer = LocalTrainingEngine(model_dir, MODEL, device="cpu")
    trainer.create_model("m", LoraSpec(rank=32, seed=1))
    one = Datum(np.array([5]), {"target_tokens": np.array([6]), "weights": np.ones(1, np.float32)})
    forward = PassRequest("r", "m", "cross_entropy", {}, True, [one])
    backward = PassRequest("r", "m", "cross_entropy", {}, False, [one])
    sampler = LocalSamplingEngine(model_dir, MODEL)
    sample = SampleRequest("s", None, [5], 1, SampleParams(max_tokens=1, seed=0))
    calls = {
        "forward": lambda: trainer.run_passes([forward]),
        "forward_backward": lambda: trainer.run_passes([backward]),
        "sample": lambda: sampler.sample([sample]),
    }
    out = {name: timed(call, n, f"in-process {name}") for name, call in calls.items()}
    for name in PROFILED:  # idle between calls as the server's engine is (spans: idle wake)
        out[f"{name} paced"] = timed(calls[name], n, f"in-process {name}, paced", IDLE_BETWEEN_S)
    trainer.close()
    return out


class RedisCounter:
    """Commands the server's Redis processed and the scheduler's round trips to it, each less
    its idle rate (ticks, heartbeats, probes)."""

    def __init__(self, server: Server, scheduler_metrics: str) -> None:
        url = (server.data_dir / "redis" / "url").read_text().strip()
        self.url = url
        self.redis = redis.Redis.from_url(url)
        self.metrics_url = scheduler_metrics
        start, began = self.totals(), time.monotonic()
        time.sleep(5)
        self.idle_per_s = self.rates(start, began)

    def totals(self) -> np.ndarray:
        commands = int(self.redis.info("stats")["total_commands_processed"]) - 1  # INFO itself
        found = spans.scrape(self.metrics_url, ("lockstep_redis_round_trips_total",))
        return np.array([commands, sum(found.values())], dtype=float)

    def rates(self, start: np.ndarray, began: float) -> np.ndarray:
        return np.asarray((self.totals() - start) / (time.monotonic() - began))

    def per_request(
        self, run: Callable[[], list[float]], n: int
    ) -> tuple[list[float], float, float]:
        start, began = self.totals(), time.monotonic()
        times = run()
        spent = self.totals() - start - self.idle_per_s * (time.monotonic() - began)
        commands, trips = spent / (n + 3)  # timed() also ran three warm-up requests
        return times, float(commands), float(trips)


def through_sdk(
    server: Server, n: int, counter: RedisCounter, http_log: spans.HttpLog, urls: dict[str, str]
) -> dict[str, Any]:
    client = tinker.ServiceClient(base_url=server.base_url, api_key=API_KEY)
    trainer = client.create_lora_training_client(base_model=MODEL, rank=32, seed=1).result()
    sampler = client.create_sampling_client(base_model=MODEL)
    one = types.Datum(
        model_input=types.ModelInput.from_ints([5]),
        loss_fn_inputs={
            "target_tokens": types.TensorData.from_numpy(np.array([6])),
            "weights": types.TensorData.from_numpy(np.ones(1, np.float32)),
        },
    )
    prompt = types.ModelInput.from_ints([5])
    params = types.SamplingParams(max_tokens=1, seed=0)
    # The SDK does not expose its futures' request ids: take one from a request made over plain
    # HTTP (unloading a throwaway model) and retrieve it once it has finished.
    spare = client.create_lora_training_client(base_model=MODEL, rank=4).result()
    http = httpx.Client(base_url=server.base_url, headers={"X-API-Key": API_KEY}, timeout=30)
    unload = {"model_id": spare.model_id, "type": "unload_model"}
    retrieve = {"request_id": http.post("/api/v1/unload_model", json=unload).json()["request_id"]}

    def retrieve_once() -> None:
        http.post("/api/v1/retrieve_future", json=retrieve).raise_for_status()

    calls: dict[str, Callable[[], object]] = {
        "forward": lambda: trainer.forward([one], "cross_entropy").result(),
        "forward_backward": lambda: trainer.forward_backward([one], "cross_entropy").result(),
        "sample": lambda: sampler.sample(prompt, num_samples=1, sampling_params=params).result(),
        "retrieve": retrieve_once,
    }
    out: dict[str, Any] = {}
    for name, call in calls.items():
        times, commands, trips = counter.per_request(partial(timed, call, n, f"SDK {name}"), n)
        out[name] = {"times": times, "redis_commands": commands, "redis_round_trips": trips}
    http.close()
    # The span profile: the same requests again, one at a time, metrics scraped around each.
    recorded = {
        kind: spans.record(calls[kind], n, http_log, urls["gateway"], urls["scheduler"])
        for kind in tqdm(PROFILED, desc="span profile")
    }
    trace = spans.export_trace(server.base_url, API_KEY, trainer.model_id.split(":train:")[0])
    for kind, samples in recorded.items():
        spans.attach_trace(samples, trace, kind)
    return {"requests": out, "profiled": recorded}


def scheduler_cpu(server: Server, tenants: int, steps: int) -> dict[str, float]:
    """8 pipelined tenants; the scheduler process's CPU seconds (not its engine children)."""
    client = tinker.ServiceClient(base_url=server.base_url, api_key=API_KEY)
    trainers = [
        client.create_lora_training_client(base_model=MODEL, rank=16, seed=i).result()
        for i in range(tenants)
    ]
    rng = np.random.default_rng(0)
    data = [
        types.Datum(
            model_input=types.ModelInput.from_ints(rng.integers(0, 1000, 64).tolist()),
            loss_fn_inputs={
                "target_tokens": types.TensorData.from_numpy(rng.integers(0, 1000, 64))
            },
        )
        for _ in range(2)
    ]
    adam = types.AdamParams(learning_rate=1e-4)

    def loop(t: tinker.TrainingClient) -> None:
        for _ in range(steps):
            fb, opt = t.forward_backward(data, "cross_entropy"), t.optim_step(adam)
            fb.result()
            opt.result()

    for t in trainers:  # warm-up: every adapter's first step
        t.forward_backward(data, "cross_entropy").result()
    cpu0, wall0 = cpu_seconds_by_role(server)["scheduler"], time.monotonic()
    threads = [threading.Thread(target=loop, args=(t,)) for t in trainers]
    for th in threads:
        th.start()
    for th in tqdm(threads, desc=f"{tenants} tenants x {steps} steps"):
        th.join()
    cpu = cpu_seconds_by_role(server)["scheduler"] - cpu0
    wall = time.monotonic() - wall0
    return {"tenants": tenants, "steps": steps, "wall_s": wall, "cpu_s": cpu, "share": cpu / wall}


def path_floors(floors: dict[str, Any]) -> dict[str, Any]:
    """What the hops on each request's path (PATH_HOPS) cost at their barest."""
    return {
        kind: {
            "hops": hops,
            "p50_ms": sum(count * floors[hop]["p50_ms"] for hop, count in hops.items()),
        }
        for kind, hops in PATH_HOPS.items()
    }


def ms(values: list[float], q: float) -> float:
    return float(np.quantile(values, q)) * 1000


def summarize(sdk: dict[str, Any], local: dict[str, list[float]]) -> list[dict[str, Any]]:
    rows = []
    for name, res in sdk.items():
        base = statistics.median(local[name]) * 1000 if name in local else 0.0
        paced = local.get(f"{name} paced")
        rows.append(
            {
                "request": name,
                "in_process_p50_ms": base,
                "in_process_paced_p50_ms": statistics.median(paced) * 1000 if paced else None,
                "sdk_p50_ms": ms(res["times"], 0.5),
                "sdk_p99_ms": ms(res["times"], 0.99),
                "added_p50_ms": ms(res["times"], 0.5) - base,
                "added_p99_ms": ms(res["times"], 0.99) - base,
                "redis_commands": res["redis_commands"],
                "redis_round_trips": res["redis_round_trips"],
            }
        )
    return rows


def target_checks(rows: list[dict[str, Any]], cpu_share: float) -> list[dict[str, Any]]:
    """Each of TARGETS: the measured value, the goal, met or missed."""
    by_kind = {r["request"]: r for r in rows}
    out = []
    for kind, goals in TARGETS.items():
        if isinstance(goals, dict):
            for key, goal in goals.items():
                out.append({"target": f"{kind} {key}", "value": by_kind[kind][key], "goal": goal})
        else:
            out.append({"target": kind, "value": cpu_share, "goal": goals})
    return [t | {"met": t["value"] <= t["goal"]} for t in out]


def plot(
    rows: list[dict[str, Any]], profiles: dict[str, dict[str, Any]], floors: dict[str, Any]
) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [3, 2]})
    names = [r["request"] for r in rows]
    x = np.arange(len(names))
    ax.bar(x - 0.2, [r["added_p50_ms"] for r in rows], 0.4, label="added p50")
    ax.bar(x + 0.2, [r["added_p99_ms"] for r in rows], 0.4, label="added p99")
    for i, name in enumerate(names):
        goals = TARGETS.get(name)
        if isinstance(goals, dict) and "added_p50_ms" in goals:
            ax.hlines(goals["added_p50_ms"], i - 0.4, i, colors="black", linestyles="--")
            ax.hlines(goals["added_p99_ms"], i, i + 0.4, colors="black", linestyles="--")
        if name in floors:
            ax.hlines(floors[name]["p50_ms"], i - 0.4, i, colors="dimgray", linestyles=":", lw=2)
    ax.set_xticks(x, names)
    ax.set_ylabel("ms over the in-process call\n(dashes: targets; dots: the path's bare hops)")
    ax.set_title("added latency per minimal request (gather window 0)")
    ax.legend()
    kinds = [k for k, p in profiles.items() if p.get("requests")]
    bottom = np.zeros(len(kinds))
    cmap = plt.get_cmap("tab20")
    colors = [cmap(i) for i in range(len(spans.PARTS))]
    for part, color in zip(spans.PARTS, colors, strict=True):
        values = np.array([max(profiles[k]["parts_ms"][part], 0.0) for k in kinds])
        bx.bar(kinds, values, 0.5, bottom=bottom, label=part, color=color)
        bottom += values
    for i, k in enumerate(kinds):
        bx.text(i, bottom[i], f"wall {profiles[k]['wall_ms']:.1f}", ha="center", va="bottom")
    bx.set_ylabel("ms (median of each part)")
    bx.set_title("where one request's time goes")
    bx.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    path = figure_path(NAME)
    fig.savefig(path, dpi=110)
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--n", type=int, default=60, help="timed requests of each kind")
    p.add_argument("--tenants", type=int, default=8)
    p.add_argument("--steps", type=int, default=12)
    args = p.parse_args()
    results: dict[str, Any] = {"environment": environment(), "targets": TARGETS}
    local = direct(args.n)
    settle_client_heap()  # torch and the in-process engines (`direct`) are loaded by now
    gc.callbacks.append(_count_full_collections)
    http_log = spans.HttpLog()
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        server = start_server(
            Path(tmp) / "data",
            *("--clock-policy", "triggered", "--clock-gather", "0", "--metrics-port", str(port)),
        )
        urls = {
            "gateway": server.base_url + "/metrics",
            "scheduler": f"http://127.0.0.1:{port}/metrics",
        }
        try:
            counter = RedisCounter(server, urls["scheduler"])
            floors = hop_floors.floors(200, counter.url)
            sdk = through_sdk(server, args.n, counter, http_log, urls)
            cpu = scheduler_cpu(server, args.tenants, args.steps)
        finally:
            stop_server(server)
    rows = summarize(sdk["requests"], local)
    profiles = {
        kind: spans.profile(
            sdk["profiled"][kind],
            engine,
            statistics.median(local[kind]),
            statistics.median(local[f"{kind} paced"]),
        )
        for kind, engine in PROFILED.items()
    }
    checks = target_checks(rows, cpu["share"])
    idle_commands, idle_trips = counter.idle_per_s
    results.update({"n": args.n, "idle_redis_commands_per_s": idle_commands})
    results.update({"idle_redis_round_trips_per_s": idle_trips, "requests": rows})
    results.update({"spans": profiles, "scheduler_cpu": cpu, "target_checks": checks})
    results["client_full_collections"] = CLIENT_GC["full_collections"]
    results["hop_floors"] = floors
    results["path_floors"] = path_floors(floors)
    print_table(
        "added latency per minimal request (ms; SDK minus in-process)",
        [
            "request",
            "in-proc p50",
            "paced",
            "SDK p50",
            "SDK p99",
            "added p50",
            "added p99",
            "Redis cmds",
            "Redis round trips",
        ],
        [[r[k] for k in rows[0]] for r in rows],
    )
    kinds = [k for k in PROFILED if profiles[k].get("requests")]
    print_table(
        "where one request's time goes (ms, median of each part over the profiled requests)",
        ["part", *kinds],
        [
            *([part, *(profiles[k]["parts_ms"][part] for k in kinds)] for part in spans.PARTS),
            ["sum of parts", *(sum(profiles[k]["parts_ms"].values()) for k in kinds)],
            ["wall (median)", *(profiles[k]["wall_ms"] for k in kinds)],
            ["requests matched", *(profiles[k]["requests"] for k in kinds)],
        ],
    )
    print_table(
        "the hops at their barest (hop_floors.py) and a request's path over them, p50 ms",
        ["", "http", "grpc", "redis", "forward path", "sample path"],
        [
            [
                "ms",
                *(floors[h]["p50_ms"] for h in ("http", "grpc", "redis")),
                *(results["path_floors"][k]["p50_ms"] for k in PATH_HOPS),
            ]
        ],
    )
    print_table(
        "scheduler CPU with pipelined tenants",
        ["tenants", "wall s", "scheduler CPU s", "share"],
        [[cpu["tenants"], cpu["wall_s"], cpu["cpu_s"], cpu["share"]]],
    )
    print_table(
        "targets (issue #21)",
        ["target", "measured", "goal", "met"],
        [[t["target"], t["value"], t["goal"], check(t["met"])] for t in checks],
    )
    figure = plot(rows, profiles, results["path_floors"])
    results["figure"] = str(figure.relative_to(REPO_ROOT))
    write_json(NAME, results)


if __name__ == "__main__":
    main()
