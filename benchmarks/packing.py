"""Packing K tenants into one clock cycle vs running them one after another (engine level).

LocalTrainingEngine in-process on the default tiny model. Each tenant's step is forward_backward
over B datums of T tokens + optim_step; tenants have mixed LoRA ranks. Same total work:

  packed      ONE run_passes with all K tenants' requests + ONE optim_step over all K
  sequential  for each tenant: run_passes([its request]) + optim_step([its step])

Two identical sets of adapters (same specs, seeds, data) go through the two modes, interleaved rep
by rep, so both see the same machine state; packing must not change numbers, so every step's
loss:sum of a tenant must match between the modes (asserted).

    python benchmarks/packing.py [--tenants 1 2 4 8] [--batch 2] [--tokens 128] [--reps 15]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from common import check, environment, figure_path, print_table, write_json
from tqdm import tqdm

from lockstep.engine.types import AdamConfig, Datum, LoraSpec, OptimRequest, PassRequest
from lockstep.modeling.tiny import DEFAULT_MODEL_NAME, ensure_default_model
from lockstep.workers.local.trainer import LocalTrainingEngine

NAME = "packing"
RANKS = (8, 16, 32)
THROUGHPUT_TARGET = 2.5  # packed / sequential tokens/s at K=8 (report, not assert)
LATENCY_TARGET = 1.15  # packed cycle time / solo step time (report, not assert)
LOSS_RTOL = 1e-5


def tenant_spec(i: int) -> LoraSpec:
    return LoraSpec(rank=RANKS[i % len(RANKS)], alpha=32.0, seed=100 + i)


def tenant_data(i: int, batch: int, tokens: int, vocab: int) -> list[Datum]:
    rng = np.random.default_rng(1000 + i)
    data = []
    for _ in range(batch):
        seq = rng.integers(0, vocab, tokens + 1, dtype=np.int64)
        data.append(
            Datum(seq[:-1], {"target_tokens": seq[1:], "weights": np.ones(tokens, np.float32)})
        )
    return data


class Tenants:
    """K adapters of one mode ("p" packed / "s" sequential) and their per-step losses."""

    def __init__(
        self,
        engine: LocalTrainingEngine,
        mode: str,
        k: int,
        data: list[list[Datum]],
        adam: AdamConfig,
    ) -> None:
        self.engine, self.data, self.adam = engine, data, adam
        self.ids = [f"{mode}{k}-{i}" for i in range(k)]
        for i, model_id in enumerate(self.ids):
            engine.create_model(model_id, tenant_spec(i))
        self.losses: list[list[float]] = [[] for _ in self.ids]

    def requests(self, idx: list[int]) -> list[PassRequest]:
        return [
            PassRequest(f"fb-{self.ids[i]}", self.ids[i], "cross_entropy", {}, False, self.data[i])
            for i in idx
        ]

    def step(self, idx: list[int]) -> tuple[float, float]:
        """One cycle over tenants `idx`: (pass seconds, optimizer seconds)."""
        t0 = time.perf_counter()
        results = self.engine.run_passes(self.requests(idx))
        t1 = time.perf_counter()
        self.engine.optim_step([OptimRequest(self.ids[i], self.adam) for i in idx])
        t2 = time.perf_counter()
        for i, res in zip(idx, results, strict=True):
            self.losses[i].append(res.metrics["loss:sum"])
        return t1 - t0, t2 - t1

    def close(self) -> None:
        for model_id in self.ids:
            self.engine.delete_model(model_id)


def measure(engine: LocalTrainingEngine, k: int, args: argparse.Namespace) -> dict[str, Any]:
    vocab = engine.card().vocab_size
    data = [tenant_data(i, args.batch, args.tokens, vocab) for i in range(k)]
    adam = AdamConfig(learning_rate=args.lr)
    packed, seq = Tenants(engine, "p", k, data, adam), Tenants(engine, "s", k, data, adam)
    t_pass, t_optim, t_packed, t_seq, t_solo = [], [], [], [], []
    try:
        for rep in tqdm(range(args.warmup + args.reps), desc=f"K={k}", leave=False):
            # Alternate which mode goes first so drift on the machine hits both alike.
            for mode in ("packed", "sequential")[:: 1 if rep % 2 == 0 else -1]:
                if mode == "packed":
                    p, o = packed.step(list(range(k)))
                    if rep >= args.warmup:
                        t_pass.append(p)
                        t_optim.append(o)
                        t_packed.append(p + o)
                else:
                    solo = [sum(seq.step([i])) for i in range(k)]
                    if rep >= args.warmup:
                        t_seq.append(sum(solo))
                        t_solo.extend(solo)
        diffs = [
            abs(a - b) / max(1.0, abs(b))
            for lp, ls in zip(packed.losses, seq.losses, strict=True)
            for a, b in zip(lp, ls, strict=True)
        ]
    finally:
        packed.close()
        seq.close()
    tokens = k * args.batch * args.tokens
    med = statistics.median
    out = {
        "tenants": k,
        "ranks": [tenant_spec(i).rank for i in range(k)],
        "tokens_per_cycle": tokens,
        "packed_cycle_s": med(t_packed),
        "packed_pass_s": med(t_pass),
        "packed_optim_s": med(t_optim),
        "sequential_s": med(t_seq),
        "solo_step_s": med(t_solo),
        "packed_tokens_per_s": tokens / med(t_packed),
        "sequential_tokens_per_s": tokens / med(t_seq),
        "throughput_ratio": med(t_seq) / med(t_packed),
        "per_tenant_latency_ratio": med(t_packed) / med(t_solo),
        "loss_max_rel_diff": max(diffs),
        "losses_packed": packed.losses,
        "losses_sequential": seq.losses,
        "raw_s": {"packed": t_packed, "sequential": t_seq, "solo": t_solo},
    }
    return out


def report(rows: list[dict[str, Any]]) -> None:
    last = rows[-1]
    print_table(
        "Packed (one run_passes + one optim_step) vs sequential (per tenant); medians; "
        f"LoRA ranks cycle {'/'.join(map(str, RANKS))}",
        [
            "K",
            "tokens/cycle",
            "packed tok/s",
            "seq tok/s",
            "throughput ×",
            "packed cycle ms",
            "(pass / optim)",
            "solo step ms",
            "per-tenant ×",
            "loss rel diff",
        ],
        [
            [
                r["tenants"],
                r["tokens_per_cycle"],
                r["packed_tokens_per_s"],
                r["sequential_tokens_per_s"],
                r["throughput_ratio"],
                1e3 * r["packed_cycle_s"],
                f"{1e3 * r['packed_pass_s']:.1f} / {1e3 * r['packed_optim_s']:.1f}",
                1e3 * r["solo_step_s"],
                r["per_tenant_latency_ratio"],
                f"{r['loss_max_rel_diff']:.1e}",
            ]
            for r in rows
        ],
    )
    k = last["tenants"]
    print_table(
        f"Targets at K={k} (reported, not asserted)",
        ["target", "measured", ""],
        [
            [
                f"throughput packed/sequential ≥ {THROUGHPUT_TARGET}×",
                last["throughput_ratio"],
                check(last["throughput_ratio"] >= THROUGHPUT_TARGET),
            ],
            [
                f"per-tenant step packed/solo ≤ {LATENCY_TARGET}×",
                last["per_tenant_latency_ratio"],
                check(last["per_tenant_latency_ratio"] <= LATENCY_TARGET),
            ],
            [
                f"loss:sum packed == sequential (rel ≤ {LOSS_RTOL:g})",
                max(r["loss_max_rel_diff"] for r in rows),
                "[green]asserted[/green]",
            ],
        ],
    )


def last_missed(rows: list[dict[str, Any]]) -> bool:
    last = rows[-1]
    return bool(
        last["throughput_ratio"] < THROUGHPUT_TARGET
        or last["per_tenant_latency_ratio"] > LATENCY_TARGET
    )


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = [r["tenants"] for r in rows]
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4.4))
    ax1.plot(ks, [r["packed_tokens_per_s"] for r in rows], "o-", label="packed (one cycle)")
    ax1.plot(ks, [r["sequential_tokens_per_s"] for r in rows], "s-", label="sequential")
    ax1.set_ylim(bottom=0)
    ax1.set_ylabel("aggregate tokens/s (fwd+bwd+optim)")
    ax1.set_title("throughput")
    ax1.legend(loc="lower right")
    panels = [
        (
            ax2,
            "throughput_ratio",
            "tab:green",
            "packed / sequential tokens/s",
            f"target ≥ {THROUGHPUT_TARGET}× at K={ks[-1]}",
            THROUGHPUT_TARGET,
        ),
        (
            ax3,
            "per_tenant_latency_ratio",
            "tab:red",
            "packed cycle / solo step",
            f"target ≤ {LATENCY_TARGET}×",
            LATENCY_TARGET,
        ),
    ]
    for ax, key, color, label, target_label, target in panels:
        vals = [r[key] for r in rows]
        ax.plot(ks, vals, "o-", color=color, label=label)
        ax.plot(ks, ks, ":", color="grey", lw=1, label="K")
        ax.axhline(target, color=color, ls="--", lw=1, label=target_label)
        for k, v in zip(ks, vals, strict=True):
            ax.annotate(
                f"{v:.2f}",
                (k, v),
                textcoords="offset points",
                xytext=(0, 7),
                ha="center",
                fontsize=8,
            )
        ax.set_ylim(bottom=0)
        ax.set_ylabel("ratio")
        ax.legend(fontsize=8, loc="upper left")
    ax2.set_title("packing gain (higher is better)")
    ax3.set_title("latency a tenant sees, packed vs alone (lower is better)")
    for ax in (ax1, ax2, ax3):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ks, [str(k) for k in ks])
        ax.set_xlabel("tenants K")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tenants", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--batch", type=int, default=2, help="datums per tenant step (B)")
    p.add_argument("--tokens", type=int, default=128, help="tokens per datum (T)")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--name", default=NAME, help="results file stem (benchmarks/results/NAME.*)")
    p.add_argument(
        "--data-dir",
        type=Path,
        default=Path.home() / ".cache" / "lockstep-bench",
        help="where the default tiny model is built",
    )
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = ensure_default_model(args.data_dir)
    engine = LocalTrainingEngine(model_dir, DEFAULT_MODEL_NAME, device="cpu")
    rows = [measure(engine, k, args) for k in args.tenants]
    report(rows)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    path = write_json(
        args.name,
        {
            "config": config,
            "environment": environment(),
            "targets": {
                "throughput_min": THROUGHPUT_TARGET,
                "latency_max": LATENCY_TARGET,
                "loss_rtol": LOSS_RTOL,
            },
            "results": rows,
        },
    )
    png = figure_path(args.name)
    plot(
        rows,
        png,
        f"Lockstep packing: {DEFAULT_MODEL_NAME}, B={args.batch} × T={args.tokens} "
        f"per tenant, CPU × {torch.get_num_threads()} threads",
    )
    print(f"wrote {path} and {png}")
    if last_missed(rows):
        print(
            "targets missed: `python benchmarks/packing_profile.py` shows where a packed cycle "
            "spends its time, op by op, against K solo steps"
        )
    worst = max(r["loss_max_rel_diff"] for r in rows)
    assert worst <= LOSS_RTOL, f"packing changed a tenant's loss:sum (max rel diff {worst:.2e})"


if __name__ == "__main__":
    main()
