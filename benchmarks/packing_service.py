"""Packing K tenants per clock cycle vs one tenant per cycle, end to end through the real SDK.

`benchmarks/packing.py` measures the engine alone; this is what a user sees. K SDK clients (one
thread each, mixed LoRA ranks) run the same pipelined loop at once against a real `lockstep
serve`: each step is forward_backward over B datums of T tokens + optim_step, step k+1 submitted
before step k's results are awaited. Two servers, same everything except the token budget:

  packed          the default budget: every tenant's step fits in one cycle
  one-per-cycle   budget = one tenant's step: each cycle serves one tenant, the others wait
                  (how servers that run tenants one at a time behave)

and, on the packed server, ONE tenant sending all K tenants' datums in each step (the ideal
packing approaches: the same tokens per cycle through one adapter and one client), its LoRA rank
the K tenants' mean rank so both do the same LoRA FLOPs per token.

Reported per K: aggregate tokens/s of all three, packed over each, and each tenant's step time
(median over tenants of its mean step time) relative to the packed K=1 step. Both servers train
identical adapters on identical data, so every tenant's per-step loss:sum must match between the
two (asserted: packing must not change numbers).

    python benchmarks/packing_service.py [--tenants 1 2 4 8] [--batch 2] [--tokens 128] [--steps 12]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from clock_cycles import TIMEOUT_S
from common import (
    API_KEY,
    Server,
    check,
    cpu_seconds_by_role,
    environment,
    figure_path,
    print_table,
    start_server,
    stop_server,
    write_json,
)
from tqdm import tqdm

NAME = "packing_service"
RANKS = (8, 16, 32)
THROUGHPUT_TARGET = 2.5  # packed / one-per-cycle aggregate tokens/s at the largest K
ONE_TENANT_TARGET = 0.85  # packed / one tenant sending every datum, at the largest K
LATENCY_TARGET = 1.15  # a tenant's step packed with K-1 others / its step alone
LOSS_RTOL = 1e-5
MODES = {"packed": None, "one-per-cycle": "tenant"}  # --token-budget: default / one tenant's


def tenant_data(i: int, batch: int, tokens: int, vocab: int) -> list[Any]:
    from tinker import types

    rng = np.random.default_rng(1000 + i)
    data = []
    for _ in range(batch):
        seq = rng.integers(0, vocab, tokens + 1, dtype=np.int64)
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(seq[:-1].tolist()),
                loss_fn_inputs={
                    "target_tokens": types.TensorData.from_numpy(seq[1:]),
                    "weights": types.TensorData.from_numpy(np.ones(tokens, np.float32)),
                },
            )
        )
    return data


async def pipelined(
    tc: Any, data: list[Any], steps: int, lr: float, bar: tqdm
) -> list[tuple[float, float, int]]:
    """(completion time, loss:sum, clock cycle) per step of a pipelined loop."""
    from tinker import types

    out: list[tuple[float, float, int]] = []
    pending = None
    for k in range(steps + 1):
        nxt = None
        if k < steps:
            nxt = (
                tc.forward_backward(data, "cross_entropy"),
                tc.optim_step(types.AdamParams(learning_rate=lr)),
            )
        if pending is not None:
            fb = await pending[0].result_async(TIMEOUT_S)
            await pending[1].result_async(TIMEOUT_S)
            out.append(
                (time.perf_counter(), fb.metrics["loss:sum"], int(fb.metrics["clock_cycle:unique"]))
            )
            bar.update(1)
        pending = nxt
    return out


def tenant_ranks(k: int) -> list[int]:
    """The LoRA ranks of K packed tenants: a mix, as real tenants bring."""
    return [RANKS[i % len(RANKS)] for i in range(k)]


def run_tenants(
    server: Server,
    base_model: str,
    data: list[list[Any]],
    args: argparse.Namespace,
    tag: str,
    ranks: list[int] | None = None,
) -> dict[str, Any]:
    """One SDK client per entry of `data` (that client's datums), all pipelined at once."""
    import tinker

    k = len(data)
    ranks = ranks or tenant_ranks(k)
    service = tinker.ServiceClient(base_url=server.base_url, api_key=API_KEY)
    clients = [
        service.create_lora_training_client(
            base_model=base_model, rank=ranks[i], seed=100 + i
        ).result()
        for i in range(k)
    ]
    results: list[list[tuple[float, float, int]]] = [[] for _ in range(k)]
    start = threading.Barrier(k)
    bar = tqdm(total=k * args.steps, desc=f"{tag} K={k}", leave=False)

    def tenant(i: int) -> None:
        start.wait()
        results[i] = asyncio.run(pipelined(clients[i], data[i], args.steps, args.lr, bar))

    threads = [threading.Thread(target=tenant, args=(i,)) for i in range(k)]
    t0 = time.perf_counter()
    cpu0 = cpu_seconds_by_role(server)
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    cpu1 = cpu_seconds_by_role(server)
    bar.close()
    if any(len(r) != args.steps for r in results):
        raise RuntimeError(f"{tag} K={k}: a tenant did not finish its steps")
    w = args.warmup
    # Steady state: from the end of the warm-up steps to the end, per tenant and over all.
    step_s = [(r[-1][0] - r[w - 1][0]) / (args.steps - w) for r in results]
    wall = max(r[-1][0] for r in results) - min(r[w - 1][0] for r in results)
    tokens = sum(len(d) for d in data) * (args.steps - w) * args.tokens
    cycles = [(r[-1][2] - r[w - 1][2]) / (args.steps - w) for r in results]
    return {
        "tenants": k,
        "tokens_per_s": tokens / wall,
        "tenant_step_s": statistics.median(step_s),
        "tenant_step_s_all": step_s,
        "cycles_per_step": statistics.median(cycles),
        "losses": [[x[1] for x in r] for r in results],
        "total_s": time.perf_counter() - t0,
        # CPU seconds per step (all K tenants' step) by process role, over every step: on a
        # 2-core box where the clients share the cores, this is where packed time goes.
        "cpu_s_per_step": {r: (cpu1[r] - cpu0.get(r, 0.0)) / args.steps for r in cpu1},
    }


def measure(args: argparse.Namespace) -> dict[str, dict[int, dict[str, Any]]]:
    from lockstep.modeling.tiny import DEFAULT_MODEL_NAME

    out: dict[str, dict[int, dict[str, Any]]] = {}
    root = Path(tempfile.mkdtemp(prefix="lockstep-packing-service-"))
    for mode, budget in MODES.items():
        extra = [] if budget is None else ["--token-budget", str(args.batch * args.tokens)]
        server = start_server(root / mode, *extra)
        try:
            import tinker

            service = tinker.ServiceClient(base_url=server.base_url, api_key=API_KEY)
            probe = service.create_lora_training_client(
                base_model=DEFAULT_MODEL_NAME, rank=4
            ).result()
            vocab = probe.get_tokenizer().vocab_size
            # A throw-away run first: the first steps after start-up are slow (lazy imports,
            # allocator growth), and K=1 is the baseline every ratio divides by.
            kmax = max(args.tenants)
            data = [tenant_data(i, args.batch, args.tokens, vocab) for i in range(kmax)]
            run_tenants(server, DEFAULT_MODEL_NAME, data[:1], args, f"{mode} warm-up")
            for k in args.tenants:
                out.setdefault(mode, {})[k] = run_tenants(
                    server, DEFAULT_MODEL_NAME, data[:k], args, mode
                )
                if budget is None:  # one client with all K tenants' datums, interleaved by K
                    merged = [[d for t in data[:k] for d in t]]
                    # At the K tenants' mean rank: the same LoRA FLOPs per token (on the tiny
                    # model a rank-32 adapter adds half a base matmul), so the ratio is the
                    # cost of packing K adapters, not of their ranks.
                    rank = round(statistics.fmean(tenant_ranks(k)))
                    out.setdefault("one-tenant", {})[k] = run_tenants(
                        server, DEFAULT_MODEL_NAME, merged, args, "one tenant", [rank]
                    )
        finally:
            stop_server(server)
    return out


def summarize(raw: dict[str, dict[int, dict[str, Any]]]) -> list[dict[str, Any]]:
    packed, single, one = raw["packed"], raw["one-per-cycle"], raw["one-tenant"]
    # At the smallest K (1) the two servers do the same thing: both runs measure the solo step.
    k0 = min(packed)
    solo = statistics.fmean([packed[k0]["tenant_step_s"], single[k0]["tenant_step_s"]])
    rows = []
    for k in sorted(packed):
        p, s = packed[k], single[k]
        diffs = [
            abs(a - b) / max(1.0, abs(b))
            for lp, ls in zip(p["losses"], s["losses"], strict=True)
            for a, b in zip(lp, ls, strict=True)
        ]
        rows.append(
            {
                "tenants": k,
                "packed_tokens_per_s": p["tokens_per_s"],
                "one_per_cycle_tokens_per_s": s["tokens_per_s"],
                "throughput_ratio": p["tokens_per_s"] / s["tokens_per_s"],
                "one_tenant_tokens_per_s": one[k]["tokens_per_s"],
                "packed_over_one_tenant": p["tokens_per_s"] / one[k]["tokens_per_s"],
                "packed_tenant_step_s": p["tenant_step_s"],
                "one_per_cycle_tenant_step_s": s["tenant_step_s"],
                "per_tenant_latency_ratio": p["tenant_step_s"] / solo,
                "one_per_cycle_latency_ratio": s["tenant_step_s"] / solo,
                "packed_cycles_per_step": p["cycles_per_step"],
                "one_per_cycle_cycles_per_step": s["cycles_per_step"],
                "loss_max_rel_diff": max(diffs),
                "cpu_s_per_step": {
                    "packed": p["cpu_s_per_step"],
                    "one_tenant": one[k]["cpu_s_per_step"],
                },
            }
        )
    return rows


def report(rows: list[dict[str, Any]]) -> None:
    print_table(
        "K SDK clients at once, pipelined; packed (default budget) vs one tenant per cycle",
        [
            "K",
            "packed tok/s",
            "1/cycle tok/s",
            "throughput ×",
            "1 tenant tok/s",
            "packed / 1 tenant",
            "packed step ms",
            "1/cycle step ms",
            "per-tenant × (packed)",
            "cycles/step p | 1",
            "loss rel diff",
        ],
        [
            [
                r["tenants"],
                r["packed_tokens_per_s"],
                r["one_per_cycle_tokens_per_s"],
                r["throughput_ratio"],
                r["one_tenant_tokens_per_s"],
                r["packed_over_one_tenant"],
                1e3 * r["packed_tenant_step_s"],
                1e3 * r["one_per_cycle_tenant_step_s"],
                r["per_tenant_latency_ratio"],
                f"{r['packed_cycles_per_step']:.2f} | {r['one_per_cycle_cycles_per_step']:.2f}",
                f"{r['loss_max_rel_diff']:.1e}",
            ]
            for r in rows
        ],
    )
    last = rows[-1]
    cpu = last["cpu_s_per_step"]
    roles = sorted(set(cpu["packed"]) | set(cpu["one_tenant"]))
    print_table(
        f"CPU ms per step by process at K={last['tenants']}: packed vs one tenant, same datums",
        ["process", "packed", "one tenant", "extra"],
        [
            [
                role,
                1e3 * cpu["packed"].get(role, 0.0),
                1e3 * cpu["one_tenant"].get(role, 0.0),
                1e3 * (cpu["packed"].get(role, 0.0) - cpu["one_tenant"].get(role, 0.0)),
            ]
            for role in roles
        ],
    )
    print_table(
        f"Targets at K={last['tenants']} (reported, not asserted)",
        ["target", "measured", ""],
        [
            [
                f"throughput packed/one-per-cycle ≥ {THROUGHPUT_TARGET}×",
                last["throughput_ratio"],
                check(last["throughput_ratio"] >= THROUGHPUT_TARGET),
            ],
            [
                f"packed / one tenant sending all datums ≥ {ONE_TENANT_TARGET}×",
                last["packed_over_one_tenant"],
                check(last["packed_over_one_tenant"] >= ONE_TENANT_TARGET),
            ],
            [
                f"per-tenant step packed/alone ≤ {LATENCY_TARGET}×",
                last["per_tenant_latency_ratio"],
                check(last["per_tenant_latency_ratio"] <= LATENCY_TARGET),
            ],
            [
                f"loss:sum packed == one-per-cycle (rel ≤ {LOSS_RTOL:g})",
                max(r["loss_max_rel_diff"] for r in rows),
                "[green]asserted[/green]",
            ],
        ],
    )


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = [r["tenants"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.4))
    ax1.plot(ks, [r["packed_tokens_per_s"] for r in rows], "o-", label="packed")
    ax1.plot(ks, [r["one_per_cycle_tokens_per_s"] for r in rows], "s-", label="one per cycle")
    ax1.plot(
        ks, [r["one_tenant_tokens_per_s"] for r in rows], "^--", label="one tenant, all datums"
    )
    ax1.set_ylabel("aggregate tokens/s through the SDK")
    last = rows[-1]
    ax1.set_title(
        f"K={ks[-1]}: packed/one-per-cycle {last['throughput_ratio']:.2f}×, "
        f"packed/one tenant {last['packed_over_one_tenant']:.2f}×",
        fontsize=10,
    )
    ax2.plot(ks, [r["per_tenant_latency_ratio"] for r in rows], "o-", label="packed")
    ax2.plot(ks, [r["one_per_cycle_latency_ratio"] for r in rows], "s-", label="one per cycle")
    ax2.axhline(LATENCY_TARGET, color="tab:red", ls="--", lw=1, label=f"target ≤ {LATENCY_TARGET}×")
    ax2.set_ylabel("a tenant's step time / its step alone")
    ax2.set_title("latency a tenant sees (lower is better)")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ks, [str(k) for k in ks])
        ax.set_xlabel("tenants K")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tenants", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--name", default=NAME)
    args = p.parse_args()
    if not 1 <= args.warmup < args.steps:
        p.error("need 1 <= --warmup < --steps")
    env = environment()
    raw = measure(args)
    rows = summarize(raw)
    report(rows)
    fig = figure_path(args.name)
    plot(rows, fig)
    write_json(
        args.name,
        {
            "config": vars(args),
            "environment": env,
            "targets": {
                "throughput_min": THROUGHPUT_TARGET,
                "packed_over_one_tenant_min": ONE_TENANT_TARGET,
                "latency_max": LATENCY_TARGET,
                "loss_rtol": LOSS_RTOL,
            },
            "results": rows,
            "raw": raw,
        },
    )
    print(f"wrote benchmarks/results/{args.name}.json and {fig.relative_to(fig.parents[2])}")
    worst = max(r["loss_max_rel_diff"] for r in rows)
    if worst > LOSS_RTOL:
        raise SystemExit(f"packing changed a tenant's loss: max rel diff {worst:.2e}")


if __name__ == "__main__":
    main()
