"""Where a packed cycle spends its time, op by op, against K solo steps (engine level).

Profiles (torch.profiler, CPU) one tenant's solo step and one packed cycle of K tenants (same
tenants, data and sizes as benchmarks/packing.py), then lists each op's self time per step:
an op whose packed time exceeds K x its solo time ("growth" > 1) is a packing overhead (it grows
faster than the work); an op with growth < 1 is amortised by packing. A cProfile of the packed
cycle shows the Python side (per-adapter loops).

    python benchmarks/packing_profile.py [--tenants 8] [--batch 2] [--tokens 128] [--steps 5]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from common import RESULTS_DIR, environment, print_table, write_json
from packing import Tenants, tenant_data
from torch.profiler import ProfilerActivity, profile

from lockstep.engine.types import AdamConfig
from lockstep.modeling.tiny import DEFAULT_MODEL_NAME, ensure_default_model
from lockstep.workers.local.trainer import LocalTrainingEngine

NAME = "packing_profile"


def op_times(fn: Callable[[], Any], steps: int) -> dict[str, tuple[float, float]]:
    """op name -> (self CPU ms per step, calls per step)."""
    fn()  # warm
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            fn()
    return {
        e.key: (e.self_cpu_time_total / 1e3 / steps, e.count / steps) for e in prof.key_averages()
    }


def python_profile(fn: Callable[[], Any], steps: int, top: int) -> str:
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(steps):
        fn()
    pr.disable()
    out = io.StringIO()
    pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tenants", type=int, default=8)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--steps", type=int, default=5, help="profiled steps of each kind")
    p.add_argument("--top", type=int, default=18, help="rows in the tables")
    p.add_argument("--name", default=NAME, help="results file stem (benchmarks/results/NAME.*)")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (1: no OpenMP barriers, so other load skews less)",
    )
    p.add_argument("--data-dir", type=Path, default=Path.home() / ".cache" / "lockstep-bench")
    args = p.parse_args()
    k = args.tenants
    torch.set_num_threads(args.threads)
    engine = LocalTrainingEngine(ensure_default_model(args.data_dir), DEFAULT_MODEL_NAME, "cpu")
    data = [tenant_data(i, args.batch, args.tokens, engine.card().vocab_size) for i in range(k)]
    adam = AdamConfig(learning_rate=1e-3)
    packed, solo = Tenants(engine, "p", k, data, adam), Tenants(engine, "s", k, data, adam)
    everyone = list(range(k))

    def packed_cycle() -> None:
        packed.step(everyone)

    def solo_steps() -> None:  # every tenant once, alone: K solo steps
        for i in everyone:
            solo.step([i])

    solo_ops = op_times(solo_steps, args.steps)  # per K solo steps
    packed_ops = op_times(packed_cycle, args.steps)
    py = python_profile(packed_cycle, args.steps, args.top)

    rows: list[dict[str, Any]] = []
    for name in set(solo_ops) | set(packed_ops):
        s_ms, s_n = solo_ops.get(name, (0.0, 0.0))
        p_ms, p_n = packed_ops.get(name, (0.0, 0.0))
        rows.append(
            {
                "op": name,
                "solo_x_k_ms": s_ms,
                "packed_ms": p_ms,
                "growth": p_ms / s_ms if s_ms > 0 else None,
                "solo_x_k_calls": s_n,
                "packed_calls": p_n,
            }
        )
    rows.sort(key=lambda r: -r["packed_ms"])
    total_s = sum(r["solo_x_k_ms"] for r in rows)
    total_p = sum(r["packed_ms"] for r in rows)
    extra = sorted(rows, key=lambda r: -(r["packed_ms"] - r["solo_x_k_ms"]))
    print_table(
        f"Self CPU per step: one packed cycle of K={k} vs K solo steps "
        f"(B={args.batch}, T={args.tokens}); total {total_p:.1f} vs {total_s:.1f} ms",
        ["op", "packed ms", "K×solo ms", "growth", "packed calls", "K×solo calls"],
        [
            [
                r["op"],
                r["packed_ms"],
                r["solo_x_k_ms"],
                r["growth"],
                r["packed_calls"],
                r["solo_x_k_calls"],
            ]
            for r in rows[: args.top]
        ],
    )
    print_table(
        "Ops that packing makes MORE expensive (packed − K×solo, ms per step)",
        ["op", "extra ms", "growth", "packed calls", "K×solo calls"],
        [
            [
                r["op"],
                r["packed_ms"] - r["solo_x_k_ms"],
                r["growth"],
                r["packed_calls"],
                r["solo_x_k_calls"],
            ]
            for r in extra[:8]
        ],
    )
    print(py)
    path = write_json(
        args.name,
        {
            "config": {k_: (str(v) if isinstance(v, Path) else v) for k_, v in vars(args).items()},
            "environment": environment(),
            "total_self_cpu_ms": {"packed": total_p, "solo_x_k": total_s},
            "ops": rows,
            "python_profile_top": py,
        },
    )
    text = RESULTS_DIR / f"{args.name}.txt"
    text.write_text(py)
    print(f"wrote {path} and {text}")


if __name__ == "__main__":
    main()
