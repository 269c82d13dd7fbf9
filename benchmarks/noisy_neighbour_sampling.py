"""Noisy neighbour on the sampler: short samples alone vs beside a 4096-token generation.

Through the real `tinker` SDK against a real `lockstep serve` (default tiny model, local sampler):

  light  three tenants (one API key each), each sampling 16 tokens (greedy) from the base model,
         one sample at a time (the next is sent when the last is answered)
  heavy  one tenant generating as long as the model's context allows (4096 tokens with its
         prompt; EOS ignored), the next generation sent as soon as the last is answered

Phase "alone": the light tenants by themselves. Phase "beside": the same while the heavy tenant
generates. Per light sample: wall time from submission to its answer. The sampling lane runs
generations in slices (`--sample-slice-steps`), so a light sample waits about a slice of the long
generation for its start instead of the whole generation. Reported: light p50 / p99 in both
phases and their ratio, and how many long generations finished meanwhile.

    python benchmarks/noisy_neighbour_sampling.py [--samples 30] [--runs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from common import (
    API_KEY,
    environment,
    figure_path,
    print_table,
    settle_client_heap,
    start_server,
    stop_server,
    write_json,
)

NAME = "noisy_neighbour_sampling"
LIGHT_TENANTS = 3
LIGHT_TOKENS = 16
PROMPT = [5, 17, 42, 8]
TIMEOUT_S = 1800.0


async def light_tenant(client: Any, samples: int) -> list[float]:
    from tinker import types

    params = types.SamplingParams(max_tokens=LIGHT_TOKENS, temperature=0.0, stop=[])
    prompt = types.ModelInput.from_ints(PROMPT)
    out = []
    for _ in range(samples):
        t0 = time.perf_counter()
        result = await client.sample(prompt, 1, params)
        assert len(result.sequences[0].tokens) == LIGHT_TOKENS
        out.append(time.perf_counter() - t0)
    return out


async def heavy_tenant(client: Any, tokens: int, done: list[float]) -> None:
    """Long generations one after another until cancelled; `done`: when each finished."""
    from tinker import types

    params = types.SamplingParams(max_tokens=tokens, temperature=0.0, stop=[])
    prompt = types.ModelInput.from_ints(PROMPT)
    while True:
        result = await client.sample(prompt, 1, params)
        assert len(result.sequences[0].tokens) == tokens
        done.append(time.perf_counter())


def summarize(latencies: list[float]) -> dict[str, Any]:
    lat = np.array(latencies) * 1e3
    return {
        "samples": len(lat),
        "p50_ms": float(np.percentile(lat, 50)),
        "p99_ms": float(np.percentile(lat, 99)),
        "max_ms": float(lat.max()),
        "latencies_ms": lat.tolist(),
    }


async def phase(lights: list[Any], heavy: Any | None, args: argparse.Namespace) -> dict[str, Any]:
    heavy_task = None
    finished: list[float] = []
    t0 = time.perf_counter()
    if heavy is not None:
        heavy_task = asyncio.create_task(heavy_tenant(heavy, args.heavy_tokens, finished))
        await asyncio.sleep(args.heavy_lead_s)  # the long generation is running
    runs = await asyncio.gather(*(light_tenant(c, args.samples) for c in lights))
    elapsed = time.perf_counter() - t0
    out: dict[str, Any] = {"light": summarize([x for run in runs for x in run[args.warmup :]])}
    if heavy_task is not None:
        heavy_task.cancel()  # its generation in flight is dropped with the server
        with contextlib.suppress(asyncio.CancelledError):
            await heavy_task
        out["heavy"] = {"generations_finished": len(finished), "phase_s": elapsed}
    return out


def run(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    import tinker

    extra = ["--sample-slice-steps", str(args.slice_steps)] if args.slice_steps else []
    server = start_server(root / "serve", *extra)
    services: list[Any] = []
    try:

        def client(key: str) -> Any:
            service = tinker.ServiceClient(base_url=server.base_url, api_key=key)
            services.append(service)
            return service.create_sampling_client(base_model=args.base_model).result()

        lights = [client(f"{API_KEY}-light-{i}") for i in range(LIGHT_TENANTS)]
        heavy = client(f"{API_KEY}-heavy")
        settle_client_heap()
        alone = asyncio.run(phase(lights, None, args))
        print(f"alone: p50 {alone['light']['p50_ms']:.0f} ms p99 {alone['light']['p99_ms']:.0f}")
        beside = asyncio.run(phase(lights, heavy, args))
        print(
            f"beside: p50 {beside['light']['p50_ms']:.0f} ms p99 {beside['light']['p99_ms']:.0f}"
            f" ms; long generations finished meanwhile: {beside['heavy']}"
        )
    finally:
        for service in services:
            with contextlib.suppress(Exception):
                service.close("success").result(30)
        code = stop_server(server)
        if code != 0:
            print(f"warning: lockstep serve exited with {code}; log: {server.log_path}")
    return {
        "alone": alone,
        "beside": beside,
        "p99_ratio": beside["light"]["p99_ms"] / alone["light"]["p99_ms"],
        "p50_ratio": beside["light"]["p50_ms"] / alone["light"]["p50_ms"],
    }


def plot(results: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for n, result in enumerate(results):
        for name, color in (("alone", "tab:blue"), ("beside", "tab:orange")):
            lat = sorted(result[name]["light"]["latencies_ms"])
            label = f"16-token samples {name}" if n == 0 else None
            ax.plot(lat, np.linspace(0, 1, len(lat)), color=color, alpha=0.8, label=label)
    ax.set_xscale("log")
    ax.set_xlabel("light sample latency (ms)")
    ax.set_ylabel("fraction of samples")
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    from lockstep.modeling.tiny import DEFAULT_MODEL_NAME

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base-model", default=DEFAULT_MODEL_NAME)
    p.add_argument("--samples", type=int, default=30, help="samples per light tenant per phase")
    p.add_argument("--warmup", type=int, default=3, help="first samples per tenant not counted")
    p.add_argument("--heavy-tokens", type=int, default=4096 - len(PROMPT))
    p.add_argument("--heavy-lead-s", type=float, default=3.0)
    p.add_argument("--slice-steps", type=int, default=0, help="default: the server's")
    p.add_argument("--runs", type=int, default=1, help="whole measurements, fresh servers")
    p.add_argument("--name", default=NAME)
    args = p.parse_args()

    results = []
    for n in range(args.runs):
        with tempfile.TemporaryDirectory() as tmp:
            results.append(run(args, Path(tmp)))
        r = results[-1]
        print_table(
            f"run {n + 1}/{args.runs}: {LIGHT_TENANTS} tenants x {LIGHT_TOKENS}-token samples",
            ["phase", "p50 ms", "p99 ms", "max ms"],
            [
                [name, r[name]["light"]["p50_ms"], r[name]["light"]["p99_ms"]]
                + [r[name]["light"]["max_ms"]]
                for name in ("alone", "beside")
            ],
        )
    spread = {
        key: [min(r[key] for r in results), max(r[key] for r in results)]
        for key in ("p99_ratio", "p50_ratio")
    }
    payload: dict[str, Any] = {"environment": environment(), "args": vars(args), "spread": spread}
    payload |= results[0] if args.runs == 1 else {"runs": results}
    print(f"spread over {args.runs} run(s): {spread}")
    print(f"wrote {write_json(args.name, payload)}")
    fig = figure_path(args.name)
    ratios = ", ".join(f"{r['p99_ratio']:.2f}" for r in results)
    plot(results, fig, f"16-token samples beside a 4096-token generation; p99 ratio {ratios}")
    print(f"wrote {fig}")


if __name__ == "__main__":
    main()
