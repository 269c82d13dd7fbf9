"""Noisy neighbour: light tenants' step latency alone vs beside a heavy tenant.

Through the real `tinker` SDK against a real `lockstep serve` (default tiny model):

  light  three tenants (one API key each), 1 datum x 64 tokens, pipelined
         forward_backward + optim_step (step k+1 is submitted before step k is awaited)
  heavy  one tenant submitting as fast as it can: steps of `--heavy-calls` forward_backward
         calls of `--heavy-batch` data x `--heavy-tokens` tokens (gradient accumulation, 8192
         tokens per step by default) then an optim_step, `--heavy-depth` steps in flight

Phase "alone": the light tenants by themselves. Phase "beside": the same, with the heavy tenant
running. Per light step: wall time from submission to both results, and the clock cycles it
waited (clock_cycle of its forward_backward result minus the server's cycle counter when it was
submitted, read from /metrics). The goal: light p99 beside the heavy tenant within 2x of alone
at the same clock policy. The heavy tenant's throughput (pass tokens/s) is reported alongside.

    python benchmarks/noisy_neighbour.py [--steps 60] [--token-budget N] [--policy triggered]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass
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

from lockstep.ports import free_port

NAME = "noisy_neighbour"
LIGHT_TENANTS = 3
LIGHT_TOKENS = 64
TARGET_RATIO = 2.0  # light p99 beside / alone
TIMEOUT_S = 300.0


@dataclass
class LightStep:
    tenant: int
    step: int
    cycle: int  # clock cycle that ran its forward_backward
    latency_s: float
    cycles_waited: int  # cycle that ran it minus the last cycle started before submission


def make_datum(n: int, vocab: int, offset: int = 0) -> Any:
    from tinker import types

    tokens = (np.arange(n, dtype=np.int64) + offset) % vocab
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens.tolist()),
        loss_fn_inputs={
            "target_tokens": types.TensorData.from_numpy(tokens),
            "weights": types.TensorData.from_numpy(np.ones(n, np.float32)),
        },
    )


def cycles_started(metrics_url: str) -> int:
    """The scheduler's clock-cycle counter (lockstep_cycles_total on its --metrics-port)."""
    with urllib.request.urlopen(metrics_url, timeout=10) as resp:
        text = resp.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith("lockstep_cycles_total{"):
            total += float(line.rsplit(" ", 1)[1])
    return int(total)


async def light_tenant(
    idx: int, tc: Any, datum: Any, steps: int, metrics_url: str, lr: float
) -> list[LightStep]:
    """Pipelined: at most two steps in flight; each step's completion is timed on its own."""
    from tinker import types

    out: list[LightStep] = []

    async def one(k: int, fb: Any, opt: Any, t0: float, before: int) -> None:
        result = await fb.result_async(TIMEOUT_S)
        await opt.result_async(TIMEOUT_S)
        cycle = int(result.metrics["clock_cycle:unique"])
        out.append(LightStep(idx, k, cycle, time.perf_counter() - t0, cycle - before))

    inflight: list[asyncio.Task[None]] = []
    for k in range(steps):
        before = await asyncio.to_thread(cycles_started, metrics_url)
        t0 = time.perf_counter()
        fb = tc.forward_backward([datum], "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=lr))
        inflight.append(asyncio.create_task(one(k, fb, opt, t0, before)))
        if len(inflight) >= 2:
            await inflight.pop(0)
    await asyncio.gather(*inflight)
    return out


async def heavy_tenant(
    tc: Any, batch: list[Any], calls: int, depth: int, stop: asyncio.Event, lr: float
) -> dict[str, Any]:
    """Steps of `calls` forward_backward calls of `batch` then one optim_step (gradient
    accumulation), `depth` steps in flight, until `stop`."""
    from tinker import types

    call_tokens = sum(d.model_input.length for d in batch)
    done = 0
    per_cycle: dict[int, int] = {}  # clock cycle -> heavy pass tokens it ran
    t0 = time.perf_counter()
    inflight: list[tuple[list[Any], Any]] = []
    while not stop.is_set() or inflight:
        if not stop.is_set() and len(inflight) < depth:
            fbs = [tc.forward_backward(batch, "cross_entropy") for _ in range(calls)]
            inflight.append((fbs, tc.optim_step(types.AdamParams(learning_rate=lr))))
            continue
        fbs, opt = inflight.pop(0)
        for fb in fbs:
            cycle = int((await fb.result_async(TIMEOUT_S)).metrics["clock_cycle:unique"])
            per_cycle[cycle] = per_cycle.get(cycle, 0) + call_tokens
        await opt.result_async(TIMEOUT_S)
        done += 1
    elapsed = time.perf_counter() - t0
    return {
        "steps": done,
        "tokens_per_step": calls * call_tokens,
        "elapsed_s": elapsed,
        "tokens_per_s": done * calls * call_tokens / elapsed,
        "max_tokens_per_cycle": max(per_cycle.values(), default=0),
        "cycles_per_step": len(per_cycle) / max(done, 1),
        "tokens_per_cycle": per_cycle,
    }


def summarize(steps: list[LightStep]) -> dict[str, Any]:
    lat = np.array([s.latency_s for s in steps])
    waited = np.array([s.cycles_waited for s in steps])
    return {
        "steps": len(steps),
        "p50_ms": float(np.percentile(lat, 50) * 1e3),
        "p99_ms": float(np.percentile(lat, 99) * 1e3),
        "mean_ms": float(lat.mean() * 1e3),
        "cycles_waited_p50": float(np.percentile(waited, 50)),
        "cycles_waited_max": int(waited.max()),
    }


async def phase(
    metrics_url: str, lights: list[Any], datum: Any, args: argparse.Namespace, heavy: Any | None
) -> dict[str, Any]:
    stop = asyncio.Event()
    heavy_task = None
    if heavy is not None:
        tc, batch = heavy
        heavy_task = asyncio.create_task(
            heavy_tenant(tc, batch, args.heavy_calls, args.heavy_depth, stop, args.lr)
        )
        await asyncio.sleep(args.heavy_lead_s)  # the heavy tenant's queue fills first
    runs = await asyncio.gather(
        *(
            light_tenant(i, tc, datum, args.steps, metrics_url, args.lr)
            for i, tc in enumerate(lights)
        )
    )
    stop.set()
    steps = [s for run in runs for s in run if s.step >= args.warmup]
    out: dict[str, Any] = {"light": summarize(steps), "light_steps": [asdict(s) for s in steps]}
    if heavy_task is not None:
        done = out["heavy"] = await heavy_task
        first, last = min(s.cycle for s in steps), max(s.cycle for s in steps)
        shared = [n for c, n in done["tokens_per_cycle"].items() if first <= c <= last]
        done["shared_max_tokens_per_cycle"] = max(shared, default=0)  # beside the light tenants
        done["shared_mean_tokens_per_cycle"] = float(np.mean(shared)) if shared else 0.0
    return out


def run(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    import tinker

    metrics_port = free_port()
    metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    extra = ["--clock-policy", args.policy, "--metrics-port", str(metrics_port)]
    if args.token_budget is not None:
        extra += ["--token-budget", str(args.token_budget)]
    if args.cycle_target is not None:
        extra += ["--cycle-target", str(args.cycle_target)]
    print(f"starting lockstep serve {' '.join(extra)} ...", flush=True)
    server = start_server(root / "serve", *extra)
    services: list[Any] = []
    try:

        def client(key: str) -> Any:
            service = tinker.ServiceClient(base_url=server.base_url, api_key=key)
            services.append(service)
            return service.create_lora_training_client(
                base_model=args.base_model, rank=args.rank, seed=0
            ).result()

        lights = [client(f"{API_KEY}-light-{i}") for i in range(LIGHT_TENANTS)]
        vocab = len(lights[0].get_tokenizer())
        datum = make_datum(LIGHT_TOKENS, vocab)
        heavy_tc = client(f"{API_KEY}-heavy")
        batch = [make_datum(args.heavy_tokens, vocab, i) for i in range(args.heavy_batch)]
        for tc in [*lights, heavy_tc]:  # warm-up: first passes compile / allocate
            tc.forward_backward([datum], "cross_entropy").result(TIMEOUT_S)
        alone = asyncio.run(phase(metrics_url, lights, datum, args, None))
        print(f"alone: {alone['light']}", flush=True)
        beside = asyncio.run(phase(metrics_url, lights, datum, args, (heavy_tc, batch)))
        print(f"beside: {beside['light']} heavy: {beside['heavy']}", flush=True)
        heavy_alone = None
        if not args.no_heavy_alone:
            heavy_alone = asyncio.run(heavy_only(heavy_tc, batch, args))
            print(f"heavy alone: {heavy_alone}", flush=True)
    finally:
        for service in services:  # stop their heartbeats before the server goes away
            with contextlib.suppress(Exception):
                service.close("success").result(30)
        code = stop_server(server)
        if code != 0:
            print(f"warning: lockstep serve exited with {code}; log: {server.log_path}")
    return {
        "alone": alone,
        "beside": beside,
        "heavy_alone": heavy_alone,
        "p99_ratio": beside["light"]["p99_ms"] / alone["light"]["p99_ms"],
        "p50_ratio": beside["light"]["p50_ms"] / alone["light"]["p50_ms"],
    }


async def heavy_only(tc: Any, batch: list[Any], args: argparse.Namespace) -> dict[str, Any]:
    stop = asyncio.Event()
    task = asyncio.create_task(
        heavy_tenant(tc, batch, args.heavy_calls, args.heavy_depth, stop, args.lr)
    )
    await asyncio.sleep(args.heavy_alone_s)
    stop.set()
    return await task


def plot(result: dict[str, Any], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name in ("alone", "beside"):
        lat = sorted(s["latency_s"] * 1e3 for s in result[name]["light_steps"])
        ax.plot(lat, np.linspace(0, 1, len(lat)), label=f"light tenants {name}")
    ax.set_xscale("log")
    ax.set_xlabel("light step latency (ms, forward_backward + optim_step)")
    ax.set_ylabel("fraction of steps")
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    from lockstep.modeling.tiny import DEFAULT_MODEL_NAME

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base-model", default=DEFAULT_MODEL_NAME)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--policy", default="triggered", choices=("triggered", "periodic"))
    p.add_argument("--token-budget", type=int, default=None, help="default: the server's")
    p.add_argument(
        "--cycle-target", type=float, default=None, help="default: the server's; 0 = off"
    )
    p.add_argument("--steps", type=int, default=60, help="steps per light tenant per phase")
    p.add_argument("--warmup", type=int, default=5, help="first steps per tenant not counted")
    p.add_argument("--heavy-batch", type=int, default=8, help="datums per heavy call")
    p.add_argument("--heavy-tokens", type=int, default=128, help="tokens per heavy datum")
    p.add_argument("--heavy-calls", type=int, default=8, help="heavy calls per optim_step")
    p.add_argument("--heavy-depth", type=int, default=4, help="heavy steps in flight")
    p.add_argument("--heavy-lead-s", type=float, default=2.0)
    p.add_argument("--heavy-alone-s", type=float, default=20.0)
    p.add_argument("--no-heavy-alone", action="store_true")
    p.add_argument("--name", default=NAME)
    args = p.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        result = run(args, Path(tmp))
    payload = {"environment": environment(), "args": vars(args), **result}
    rows = []
    for name in ("alone", "beside"):
        light = result[name]["light"]
        rows.append(
            [
                name,
                light["p50_ms"],
                light["p99_ms"],
                light["cycles_waited_p50"],
                light["cycles_waited_max"],
            ]
        )
    print_table(
        f"Light tenants ({LIGHT_TENANTS} x 1 datum x {LIGHT_TOKENS} tokens, pipelined)",
        ["phase", "p50 ms", "p99 ms", "cycles waited p50", "max"],
        rows,
    )
    heavy = result["beside"]["heavy"]
    print(
        f"p99 ratio {result['p99_ratio']:.2f} {check(result['p99_ratio'] <= TARGET_RATIO)} "
        f"(<= {TARGET_RATIO}); p50 ratio {result['p50_ratio']:.2f}; heavy beside "
        f"{heavy['tokens_per_s']:,.0f} tokens/s, {heavy['cycles_per_step']:.2f} cycles per step, "
        f"in cycles with light steps at most {heavy['shared_max_tokens_per_cycle']} tokens "
        f"(mean {heavy['shared_mean_tokens_per_cycle']:.0f})"
        + (
            f", alone {result['heavy_alone']['tokens_per_s']:,.0f} tokens/s"
            if result["heavy_alone"]
            else ""
        )
    )
    print(f"wrote {write_json(args.name, payload)}")
    fig = figure_path(args.name)
    plot(result, fig, f"Noisy neighbour ({args.policy}); p99 ratio {result['p99_ratio']:.2f}")
    print(f"wrote {fig}")


if __name__ == "__main__":
    main()
