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

`--shape big`: the heavy tenant sends single forward_backward requests of 128 data x 384 tokens
(about 100x the clock's pace on a small CPU), two in flight, each followed by an optim_step: the
scheduler runs each in parts across cycles while the light tenants share the clock. Goal: light
p99 within 2x of alone and the heavy tenant at >= 70% of its alone throughput. The pace the
clock planned (lockstep_clock_token_budget) is sampled during the run and reported.

Each phase also reports how busy the machine's CPUs were (`cpu_busy`, every process) and the
CPU the engine processes used (`engine_cores`, CPU seconds per second; the trainer computes
with its share of the cores, `lockstep.workers.process.share_cores`) and `cycle_ms`: the clock's
milliseconds per cycle in each of its phases (plan, dispatch: the engine's part, collect) and
between cycles.

`heavy_ceiling` (big shape, from the alone phases only): about the most the heavy tenant can keep
while light p99 stays within 2x. A pipelined light step waits two cycles, alone or beside, so its
latency grows with the cycle: a shared cycle may last 2x the light-alone cycle. Each shared cycle
pays the light tenants' own busy time (plan + dispatch + collect, as alone) and has the rest for
whole heavy datums at the heavy-alone rate (a part is whole datums): `whole_datums` per cycle
and `fraction` of the heavy-alone rate (`tokens`: the same with no datum granularity). An
estimate: a shared cycle's costs may differ from the sum of the alone ones.

`--runs N` repeats the whole measurement on fresh servers and reports the spread.

    python benchmarks/noisy_neighbour.py [--shape steps|big] [--runs 3] [--steps 60]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from common import (
    API_KEY,
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
from usage import PHASES, Usage, cycles_started, total

from lockstep.ports import free_port

NAME = "noisy_neighbour"
LIGHT_TENANTS = 3
LIGHT_TOKENS = 64
TARGET_RATIO = 2.0  # light p99 beside / alone
TARGET_HEAVY = 0.7  # big shape: heavy tokens/s beside / alone
TIMEOUT_S = 600.0
# --shape big: one forward_backward of BIG_BATCH x BIG_TOKENS per step, BIG_DEPTH in flight.
BIG_BATCH, BIG_TOKENS, BIG_DEPTH = 128, 384, 2


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


async def watch_pace(metrics_url: str, stop: asyncio.Event) -> list[float]:
    """The pass tokens per model the clock planned (lockstep_clock_token_budget), twice a
    second until `stop`."""
    seen: list[float] = []
    while not stop.is_set():
        seen.append(await asyncio.to_thread(total, metrics_url, "lockstep_clock_token_budget"))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.5)
    return seen


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
    finished: list[float] = []  # when each step was answered (perf_counter)
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
        finished.append(time.perf_counter())
    elapsed = time.perf_counter() - t0
    return {
        "steps": done,
        "tokens_per_step": calls * call_tokens,
        "elapsed_s": elapsed,
        "finished_at": finished,
        # Between its first and last answers: no start-up, no half-done step at the end.
        "tokens_per_s": steady_rate(finished, calls * call_tokens, -np.inf, np.inf),
        "max_tokens_per_cycle": max(per_cycle.values(), default=0),
        "cycles_per_step": len(per_cycle) / max(done, 1),
        "tokens_per_cycle": per_cycle,
    }


def steady_rate(finished: list[float], tokens: int, start: float, end: float) -> float:
    """Tokens/s between the first and the last step answered within [start, end] (0.0 when
    fewer than two were)."""
    inside = [t for t in finished if start <= t <= end]
    if len(inside) < 2:
        return 0.0
    return (len(inside) - 1) * tokens / (inside[-1] - inside[0])


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
    metrics_url: str,
    lights: list[Any],
    datum: Any,
    args: argparse.Namespace,
    heavy: Any | None,
    engine_seconds: Callable[[], float],
) -> dict[str, Any]:
    stop, lights_done = asyncio.Event(), asyncio.Event()
    heavy_task = None
    if heavy is not None:
        tc, batch = heavy
        heavy_task = asyncio.create_task(
            heavy_tenant(tc, batch, args.heavy_calls, args.heavy_depth, stop, args.lr)
        )
        await asyncio.sleep(args.heavy_lead_s)  # the heavy tenant's queue fills first
    pace = asyncio.create_task(watch_pace(metrics_url, lights_done))  # while the lights run
    started, usage = time.perf_counter(), Usage(engine_seconds, metrics_url)
    runs = await asyncio.gather(
        *(
            light_tenant(i, tc, datum, args.steps, metrics_url, args.lr)
            for i, tc in enumerate(lights)
        )
    )
    ended, used = time.perf_counter(), usage.done()
    lights_done.set()
    stop.set()
    steps = [s for run in runs for s in run if s.step >= args.warmup]
    out: dict[str, Any] = {
        "light": summarize(steps),
        "light_steps": [asdict(s) for s in steps],
        **used,
    }
    paces = await pace
    out["pace_tokens_p50"] = float(np.median(paces)) if paces else 0.0
    if heavy_task is not None:
        done = out["heavy"] = await heavy_task
        # Only while the light tenants ran beside it (not its lead, not its tail alone).
        done["tokens_per_s"] = steady_rate(
            done["finished_at"], done["tokens_per_step"], started, ended
        )
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
    extra += args.serve_flag
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
        settle_client_heap()

        def engine_seconds() -> float:
            return cpu_seconds_by_role(server).get("engines", 0.0)

        alone = asyncio.run(phase(metrics_url, lights, datum, args, None, engine_seconds))
        print(f"alone: {alone['light']}", flush=True)
        beside = asyncio.run(
            phase(metrics_url, lights, datum, args, (heavy_tc, batch), engine_seconds)
        )
        print(f"beside: {beside['light']} heavy: {beside['heavy']}", flush=True)
        heavy_alone = None
        if not args.no_heavy_alone:
            heavy_alone = asyncio.run(
                heavy_only(heavy_tc, batch, args, engine_seconds, metrics_url)
            )
            print(f"heavy alone: {heavy_alone}", flush=True)
    finally:
        for service in services:  # stop their heartbeats before the server goes away
            with contextlib.suppress(Exception):
                service.close("success").result(30)
        code = stop_server(server)
        if code != 0:
            print(f"warning: lockstep serve exited with {code}; log: {server.log_path}")
    heavy_tokens = args.heavy_batch * args.heavy_tokens * args.heavy_calls
    return {
        "alone": alone,
        "beside": beside,
        "heavy_alone": heavy_alone,
        "p99_ratio": beside["light"]["p99_ms"] / alone["light"]["p99_ms"],
        "p50_ratio": beside["light"]["p50_ms"] / alone["light"]["p50_ms"],
        "heavy_fraction": (
            beside["heavy"]["tokens_per_s"] / heavy_alone["tokens_per_s"]
            if heavy_alone and heavy_alone["tokens_per_s"]
            else None
        ),
        "heavy_ceiling": heavy_ceiling(alone["cycle_ms"], heavy_alone, args.heavy_tokens),
        # How much larger than the clock's pace a heavy request is (the pace beside them).
        "request_over_pace": heavy_tokens / max(beside["pace_tokens_p50"], 1.0),
    }


async def heavy_only(
    tc: Any,
    batch: list[Any],
    args: argparse.Namespace,
    engine_seconds: Callable[[], float],
    metrics_url: str,
) -> dict[str, Any]:
    stop = asyncio.Event()
    task = asyncio.create_task(
        heavy_tenant(tc, batch, args.heavy_calls, args.heavy_depth, stop, args.lr)
    )
    usage = Usage(engine_seconds, metrics_url)
    await asyncio.sleep(args.heavy_alone_s)
    used = usage.done()
    stop.set()
    done: dict[str, Any] = await task
    return done | used


def heavy_ceiling(
    light_alone: dict[str, float], heavy_alone: dict[str, Any] | None, datum_tokens: int
) -> dict[str, float] | None:
    """The heavy tenant's ceiling beside the light tenants at TARGET_RATIO (module docstring)."""
    if heavy_alone is None or not heavy_alone["tokens_per_s"]:
        return None
    busy = sum(light_alone[p] for p in PHASES)
    cycle = TARGET_RATIO * (busy + light_alone["between"])
    datum_ms = datum_tokens * 1e3 / heavy_alone["tokens_per_s"]
    datums = max(int((cycle - busy) // datum_ms), 0)
    return {
        "cycle_ms": cycle,
        "light_busy_ms": busy,
        "whole_datums": datums,
        "fraction": datums * datum_ms / (busy + datums * datum_ms),
        "tokens": max(cycle - busy, 0.0) / cycle,
    }


def plot(results: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for n, result in enumerate(results):
        for name, color in (("alone", "tab:blue"), ("beside", "tab:orange")):
            lat = sorted(s["latency_s"] * 1e3 for s in result[name]["light_steps"])
            label = f"light tenants {name}" if n == 0 else None
            ax.plot(lat, np.linspace(0, 1, len(lat)), color=color, alpha=0.8, label=label)
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
    p.add_argument(
        "--steps", type=int, default=None, help="steps per light tenant per phase (60; big: 150)"
    )
    p.add_argument("--warmup", type=int, default=5, help="first steps per tenant not counted")
    p.add_argument("--shape", default="steps", choices=("steps", "big"))
    p.add_argument("--heavy-batch", type=int, default=None, help="datums per heavy call")
    p.add_argument("--heavy-tokens", type=int, default=None, help="tokens per heavy datum")
    p.add_argument("--heavy-calls", type=int, default=None, help="heavy calls per optim_step")
    p.add_argument("--heavy-depth", type=int, default=None, help="heavy steps in flight")
    p.add_argument("--heavy-lead-s", type=float, default=2.0)
    p.add_argument("--heavy-alone-s", type=float, default=20.0)
    p.add_argument("--no-heavy-alone", action="store_true")
    p.add_argument("--runs", type=int, default=1, help="whole measurements, fresh servers")
    p.add_argument(
        "--serve-flag",
        action="append",
        default=[],
        metavar="FLAG",
        help="one more `lockstep serve` argument (repeatable): --serve-flag=--snapshot-interval=60",
    )
    p.add_argument("--name", default=None, help="default: noisy_neighbour[_big]")
    args = p.parse_args()
    big = args.shape == "big"
    for key, steps_default, big_default in (
        ("heavy_batch", 8, BIG_BATCH),
        ("heavy_tokens", 128, BIG_TOKENS),
        ("heavy_calls", 8, 1),
        ("heavy_depth", 4, BIG_DEPTH),
        ("steps", 60, 150),  # big: the heavy tenant answers several requests beside them
    ):
        if getattr(args, key) is None:
            setattr(args, key, big_default if big else steps_default)
    args.name = args.name or (f"{NAME}_big" if big else NAME)

    results = []
    for n in range(args.runs):
        with tempfile.TemporaryDirectory() as tmp:
            results.append(run(args, Path(tmp)))
        report(results[-1], f"run {n + 1}/{args.runs}")
    spread = {
        key: [min(r[key] for r in results), max(r[key] for r in results)]
        for key in ("p99_ratio", "p50_ratio", "request_over_pace")
    }
    if all(r["heavy_fraction"] is not None for r in results):
        fractions = [r["heavy_fraction"] for r in results]
        ceilings = [r["heavy_ceiling"]["fraction"] for r in results]
        spread |= {"heavy_fraction": [min(fractions), max(fractions)]}
        spread |= {"heavy_ceiling": [min(ceilings), max(ceilings)]}
    payload: dict[str, Any] = {"environment": environment(), "args": vars(args), "spread": spread}
    payload |= results[0] if args.runs == 1 else {"runs": results}
    print(f"spread over {args.runs} run(s): {spread}")
    print(f"wrote {write_json(args.name, payload)}")
    fig = figure_path(args.name)
    ratios = ", ".join(f"{r['p99_ratio']:.2f}" for r in results)
    plot(results, fig, f"Noisy neighbour, {args.shape} ({args.policy}); p99 ratio {ratios}")
    print(f"wrote {fig}")


def report(result: dict[str, Any], title: str) -> None:
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
        f"{title}: light tenants ({LIGHT_TENANTS} x 1 datum x {LIGHT_TOKENS} tokens, pipelined)",
        ["phase", "p50 ms", "p99 ms", "cycles waited p50", "max"],
        rows,
    )
    heavy = result["beside"]["heavy"]
    fraction = result["heavy_fraction"]
    print(
        f"p99 ratio {result['p99_ratio']:.2f} {check(result['p99_ratio'] <= TARGET_RATIO)} "
        f"(<= {TARGET_RATIO}); p50 ratio {result['p50_ratio']:.2f}; heavy beside "
        f"{heavy['tokens_per_s']:,.0f} tokens/s, in cycles with light steps at most "
        f"{heavy['shared_max_tokens_per_cycle']} tokens answered (mean "
        f"{heavy['shared_mean_tokens_per_cycle']:.0f}; a request in parts counts in the cycle of "
        f"its last part); a heavy request is {result['request_over_pace']:.0f}x the pace"
        + (
            f"; heavy alone {result['heavy_alone']['tokens_per_s']:,.0f} tokens/s, beside/alone "
            f"{fraction:.2f} {check(fraction >= TARGET_HEAVY)} (>= {TARGET_HEAVY})"
            if fraction is not None
            else ""
        )
    )
    ceiling = result["heavy_ceiling"]
    alone, beside, heavy_alone = result["alone"], result["beside"], result["heavy_alone"]
    print(
        f"CPUs busy: light alone {alone['cpu_busy']:.0%}, beside {beside['cpu_busy']:.0%}"
        + (f", heavy alone {heavy_alone['cpu_busy']:.0%}" if heavy_alone else "")
        + f"; engine cores used: light alone {alone['engine_cores']:.2f}, beside "
        f"{beside['engine_cores']:.2f}"
        + (f", heavy alone {heavy_alone['engine_cores']:.2f}" if heavy_alone else "")
    )
    if ceiling is not None:
        print(
            f"ceiling (estimate): a cycle of {ceiling['cycle_ms']:.0f} ms (2x light alone) pays "
            f"the light tenants' {ceiling['light_busy_ms']:.0f} ms and holds "
            f"{ceiling['whole_datums']} whole heavy datum(s): the heavy tenant could keep about "
            f"{ceiling['fraction']:.2f} of its alone rate ({ceiling['tokens']:.2f} with no datum "
            "granularity)"
        )
    phases = [("light alone", alone), ("beside", beside), ("heavy alone", heavy_alone)]
    print(
        "clock ms per cycle (plan / dispatch / collect / between cycles): "
        + "; ".join(
            f"{name} " + " / ".join(f"{v:.1f}" for v in used["cycle_ms"].values())
            for name, used in phases
            if used
        )
    )


if __name__ == "__main__":
    main()
