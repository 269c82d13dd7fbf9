"""Load test: many concurrent tinker SDK clients against one `lockstep serve` for a while.

Each client (a thread with its own `tinker.ServiceClient` and API key, so its own tenant) loops:
forward_backward + optim_step on a small batch (both submitted, then both awaited), and every
`--sample-every` steps saves its weights for a sampler and samples from them. The script starts
the server itself, samples the RSS of every server process (psutil) while the clients run, and
reports throughput, p50/p99 latency, errors (must be 0) and memory growth (must stay bounded).

    python benchmarks/load.py [--clients 32] [--duration 300] [--batch 2] [--tokens 32]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import psutil
from common import (
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

NAME = "load"
BASE_MODEL = "Lockstep/tiny-qwen3"
RSS_PERIOD_S = 2.0
GROWTH_LIMIT = 0.25  # RSS growth from the end of warm-up to the end: report "met" below it


@dataclass
class Op:
    kind: str  # "step" (forward_backward + optim_step) | "sample" (save for sampler + sample)
    client: int
    t_end: float  # seconds since the load started
    latency_s: float


@dataclass
class Tally:
    ops: list[Op] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, op: Op) -> None:
        with self.lock:
            self.ops.append(op)

    def error(self, client: int, exc: BaseException) -> None:
        with self.lock:
            self.errors.append(f"client {client}: {type(exc).__name__}: {exc}"[:500])


def batch(rng: np.random.Generator, size: int, tokens: int) -> list[Any]:
    from tinker import types

    out = []
    for _ in range(size):
        ids = rng.integers(1, 1000, tokens + 1).tolist()
        out.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(ids[:-1]),
                loss_fn_inputs={
                    "target_tokens": types.TensorData(data=ids[1:], dtype="int64", shape=[tokens])
                },
            )
        )
    return out


def client_loop(
    i: int, a: argparse.Namespace, base_url: str, t0: float, stop: threading.Event, tally: Tally
) -> None:
    import tinker
    from tinker import types

    rng = np.random.default_rng(i)
    try:
        service = tinker.ServiceClient(base_url=base_url, api_key=f"tml-load-{i:03d}")
        trainer = service.create_lora_training_client(
            base_model=BASE_MODEL, rank=4, seed=i
        ).result()
    except Exception as exc:
        tally.error(i, exc)
        return
    step = 0
    while not stop.is_set():
        try:
            start = time.monotonic()
            fb = trainer.forward_backward(batch(rng, a.batch, a.tokens), "cross_entropy")
            opt = trainer.optim_step(types.AdamParams(learning_rate=1e-4))
            fb.result()
            opt.result()
            tally.add(Op("step", i, time.monotonic() - t0, time.monotonic() - start))
            step += 1
            if a.sample_every and step % a.sample_every == 0:
                start = time.monotonic()
                sampler = trainer.save_weights_and_get_sampling_client().result()
                sampler.sample(
                    types.ModelInput.from_ints([1, 2, 3, 4]),
                    num_samples=1,
                    sampling_params=types.SamplingParams(max_tokens=8),
                ).result()
                tally.add(Op("sample", i, time.monotonic() - t0, time.monotonic() - start))
        except Exception as exc:  # counted, and the client goes on
            tally.error(i, exc)
            traceback.print_exc()


def server_rss(pid: int) -> dict[str, float]:
    """MiB per server process, named by role (the supervisor and everything under it)."""
    out: dict[str, float] = {}
    for role, p in server_processes(pid):
        try:
            rss = p.memory_info().rss / 2**20
        except psutil.Error:
            continue
        out[role] = out.get(role, 0.0) + rss
    return out


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarize(
    a: argparse.Namespace, tally: Tally, rss: list[dict[str, Any]], elapsed: float
) -> dict[str, Any]:
    steps = [o.latency_s for o in tally.ops if o.kind == "step"]
    samples = [o.latency_s for o in tally.ops if o.kind == "sample"]
    warm = a.duration * a.warmup_fraction
    totals = [(r["t"], r["total_mib"]) for r in rss]
    after = [m for t, m in totals if t >= warm]
    base = after[0] if after else None
    end = statistics.mean(after[-3:]) if len(after) >= 3 else (after[-1] if after else None)
    growth = None if base is None or end is None else (end - base) / base
    return {
        "elapsed_s": elapsed,
        "steps": len(steps),
        "samples": len(samples),
        "steps_per_s": len(steps) / elapsed,
        "datums_per_s": len(steps) * a.batch / elapsed,
        "tokens_per_s": len(steps) * a.batch * a.tokens / elapsed,
        "step_latency_p50_s": percentile(steps, 50),
        "step_latency_p99_s": percentile(steps, 99),
        "sample_latency_p50_s": percentile(samples, 50),
        "sample_latency_p99_s": percentile(samples, 99),
        "errors": len(tally.errors),
        "clients_with_steps": len({o.client for o in tally.ops if o.kind == "step"}),
        "rss_after_warmup_mib": base,
        "rss_end_mib": end,
        "rss_peak_mib": max((m for _, m in totals), default=None),
        "rss_growth_after_warmup": growth,
    }


def plot(name: str, a: argparse.Namespace, tally: Tally, rss: list[dict[str, Any]]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (lat, mem) = plt.subplots(2, 1, figsize=(10, 8), sharex=True)
    for kind, color in (("step", "tab:blue"), ("sample", "tab:orange")):
        ops = [o for o in tally.ops if o.kind == kind]
        lat.scatter(
            [o.t_end for o in ops],
            [o.latency_s for o in ops],
            s=3,
            alpha=0.4,
            color=color,
            label=f"{kind} latency",
        )
    lat.set_ylabel("latency (s)")
    lat.set_yscale("log")
    lat.legend(loc="upper right")
    lat.set_title(
        f"{a.clients} SDK clients, batch {a.batch} x {a.tokens} tokens, "
        f"sample every {a.sample_every} steps"
    )
    roles = sorted({k for r in rss for k in r["by_role"]})
    ts = [r["t"] for r in rss]
    for role in roles:
        mem.plot(ts, [r["by_role"].get(role, 0.0) for r in rss], label=role)
    mem.plot(ts, [r["total_mib"] for r in rss], label="total", color="black", linewidth=2)
    mem.axvline(a.duration * a.warmup_fraction, color="grey", linestyle=":", label="warm-up end")
    mem.set_xlabel("seconds since the clients started")
    mem.set_ylabel("RSS (MiB)")
    mem.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    path = figure_path(name)
    fig.savefig(path, dpi=120)
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--duration", type=float, default=300.0, help="seconds of load")
    p.add_argument("--batch", type=int, default=2, help="datums per forward_backward")
    p.add_argument("--tokens", type=int, default=32, help="tokens per datum")
    p.add_argument("--sample-every", type=int, default=10, help="steps between samples (0: off)")
    p.add_argument(
        "--warmup-fraction",
        type=float,
        default=0.2,
        help="memory growth is measured from this fraction of the run on",
    )
    p.add_argument("--name", default=NAME)
    a = p.parse_args()

    data_dir = Path(tempfile.mkdtemp(prefix="lockstep-load-")) / "data"
    server = start_server(data_dir)
    tally, stop = Tally(), threading.Event()
    rss: list[dict[str, Any]] = []
    try:
        t0 = time.monotonic()
        threads = [
            threading.Thread(
                target=client_loop, args=(i, a, server.base_url, t0, stop, tally), daemon=True
            )
            for i in range(a.clients)
        ]
        for t in threads:
            t.start()
        with tqdm(total=int(a.duration), unit="s", desc=f"{a.clients} clients") as bar:
            while (now := time.monotonic() - t0) < a.duration:
                by_role = server_rss(server.proc.pid)
                total = sum(by_role.values())
                rss.append(
                    {
                        "t": round(now, 2),
                        "total_mib": round(total, 1),
                        "by_role": {k: round(v, 1) for k, v in by_role.items()},
                    }
                )
                bar.n = int(now)
                steps = sum(1 for o in tally.ops if o.kind == "step")
                bar.set_postfix(steps=steps, errors=len(tally.errors), rss_mib=int(total))
                time.sleep(RSS_PERIOD_S)
        stop.set()
        for t in threads:
            t.join(180)  # each finishes the step it is in
        elapsed = time.monotonic() - t0
    finally:
        stop.set()
        code = stop_server(server)
    summary = summarize(a, tally, rss, elapsed)
    summary["server_exit_code"] = code
    png = plot(a.name, a, tally, rss)
    payload = {
        "config": vars(a),
        "environment": environment(),
        "summary": summary,
        "errors": tally.errors[:50],
        "rss": rss,
        "ops": [
            {k: round(v, 4) if isinstance(v, float) else v for k, v in asdict(o).items()}
            for o in tally.ops
        ],
    }
    path = write_json(a.name, payload)
    growth = summary["rss_growth_after_warmup"]
    print_table(
        f"load: {a.clients} clients for {a.duration:.0f} s",
        ["metric", "value", ""],
        [
            ("steps/s (fb + optim)", summary["steps_per_s"], ""),
            ("tokens/s trained", summary["tokens_per_s"], ""),
            (
                "step latency p50 / p99 (s)",
                f"{summary['step_latency_p50_s']:.3g} / {summary['step_latency_p99_s']:.3g}",
                "",
            ),
            (
                "sample latency p50 / p99 (s)",
                f"{summary['sample_latency_p50_s'] or 0:.3g}"
                f" / {summary['sample_latency_p99_s'] or 0:.3g}",
                "",
            ),
            ("errors", summary["errors"], check(summary["errors"] == 0)),
            (
                "clients that trained",
                summary["clients_with_steps"],
                check(summary["clients_with_steps"] == a.clients),
            ),
            (
                "RSS after warm-up -> end (MiB)",
                f"{summary['rss_after_warmup_mib'] or 0:.0f} -> {summary['rss_end_mib'] or 0:.0f}",
                check(growth is not None and growth < GROWTH_LIMIT),
            ),
        ],
    )
    print(f"wrote {path} and {png}")


if __name__ == "__main__":
    main()
