"""What one packed cycle launches, op by op, per family and number of tenants: on a CPU, with
the code paths a CUDA device takes (no GPU needed; counts and bytes do not depend on load).

For each family of the tiny model zoo (lockstep/modeling/zoo.py) and K = 1, 8, 32 tenants (one
datum of 64 tokens each, rank 16 on attention and MLP / experts, so the tokens grow with K), ONE
cycle of the local trainer (`run_passes`: every tenant's datum in one fused forward + backward;
`optim_step`: one batched AdamW) after a warm-up cycle, counted by `lockstep.modeling.op_census`
(`lockstep.workers.local.cycle_census`):

  ops_per_layer     kernel ops per decoder layer, forward + backward (views, allocations and host
                    reads apart: no kernel on a GPU); attributed to layers by wrapping each
                    layer's forward and stamping the autograd nodes it makes, so its backward
                    counts there too. The head and per-row loss (per row by design), the
                    gradient accumulation into each adapter's tensors and the optimizer count
                    apart (`regions`).
  cast_bytes        bytes written by dtype-converting copies (`_to_copy`, `copy_` across dtypes,
                    `_foreach_copy_`), with their top sources (calling line; backward: the node
                    and the line that made it)
  max_groups        the largest grouped GEMM group count (`torch._grouped_mm`'s offs)

Paths (`lockstep.modeling.cuda_paths`): base weights in bf16 (`--dtype`), the linear LoRA's
grouped GEMM pair over every adapter, CUDA's group limit, and VARLEN attention (one varlen call
per packed sequence where the layer allows it) through a CPU stand-in kernel counted as the one
call CUDA makes. Each K also runs with VARLEN off (today's default on CUDA: attention per row):
`ops_per_layer_varlen_off`. At K = 8 the `lora_gemms_in_base_dtype` variant (the linear LoRA's
grouped GEMMs in bf16, `linear_lora.GROUPED_IN_BASE_DTYPE`) shows what it saves in casts.

    python benchmarks/op_census.py [--families qwen3 ...] [--tenants 1 8 32] [--tokens 64]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

import torch
from common import environment, figure_path, print_table, write_json
from rich.progress import Progress

from lockstep.modeling import linear_lora, zoo
from lockstep.modeling.cuda_paths import cuda_paths
from lockstep.workers.local.cycle_census import census_cycle
from lockstep.workers.local.micro_batches import padded
from lockstep.workers.local.trainer import LocalTrainingEngine

NAME = "op_census"
VARIANT_K = 8


def census_family(
    family: str, args: argparse.Namespace, data_dir: Path, progress: Progress, task: Any
) -> tuple[dict[str, Any], dict[str, Any]]:
    """{K: summary} of one family, and the paths it ran on."""
    engine = LocalTrainingEngine(
        zoo.ensure_family(family, data_dir),
        zoo.served_name(family),
        device="cpu",
        dtype=args.dtype,
        micro_batch_tokens=max(args.tenants) * padded(args.tokens),  # one micro-batch
    )
    out: dict[str, Any] = {}
    try:
        with cuda_paths(varlen=True) as paths:
            for k in args.tenants:
                progress.update(task, description=f"{family} K={k}")
                out[str(k)] = census_cycle(engine, k, args.tokens, args.rank)
                progress.advance(task)
            progress.update(task, description=f"{family} K={VARIANT_K} bf16 LoRA GEMMs")
            linear_lora.GROUPED_IN_BASE_DTYPE = True
            try:
                base = census_cycle(engine, VARIANT_K, args.tokens, args.rank)
            finally:
                linear_lora.GROUPED_IN_BASE_DTYPE = False
            progress.advance(task)
        with cuda_paths(varlen=False):
            for k in args.tenants:
                progress.update(task, description=f"{family} K={k} varlen off")
                off = census_cycle(engine, k, args.tokens, args.rank)
                out[str(k)]["ops_per_layer_varlen_off"] = off["ops_per_layer"]
                progress.advance(task)
    finally:
        engine.close()
    if str(VARIANT_K) in out:
        out[str(VARIANT_K)]["variants"] = {
            "lora_gemms_in_base_dtype": {
                key: base[key] for key in ("ops_per_layer", "cast_bytes", "cast_top_sources")
            }
        }
    return out, paths


def growth(per_k: dict[str, Any]) -> dict[str, Any]:
    """Whether ops per layer grow between the two largest K (both past the single-adapter
    path one tenant takes), and where: each layer part whose kernel ops grow."""
    ks = sorted(per_k, key=int)
    lo, hi = per_k[ks[-2]], per_k[ks[-1]]
    where = []
    for i, (a, b) in enumerate(zip(lo["layers"], hi["layers"], strict=True)):
        for part, n in b["parts"].items():
            before = a["parts"].get(part, 0)
            if n > before:
                where.append(f"layer {i} ({b['kind']}) {part}: {before} -> {n}")
    by_design = {
        region: [per_k[k]["regions"][region]["kernel_ops"] for k in ks]
        for region in ("head_loss", "optimizer")
    }
    return {
        "ops_per_layer_grows": hi["ops_per_layer"] > lo["ops_per_layer"],
        "compared": [int(ks[-2]), int(ks[-1])],
        "where": where,
        # > 1: not a packed family (the generic path runs every row as its own forward)
        "micro_batches": [per_k[k]["micro_batches"] for k in ks],
        "apart": by_design,  # per row / per tenant by design
    }


def figure(payload: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    families = payload["families"]
    fig, (ops_ax, cast_ax) = plt.subplots(1, 2, figsize=(14, 5.6))
    cmap = plt.get_cmap("tab20")
    colors = [cmap(i) for i in range(cmap.N)]
    for i, (family, per_k) in enumerate(families.items()):
        color = colors[(2 * i) % 20 if i < 10 else (2 * i + 1) % 20]
        ks = sorted(per_k, key=int)
        x = [int(k) for k in ks]
        ops_ax.plot(x, [per_k[k]["ops_per_layer"] for k in ks], "o-", color=color, label=family)
        ops_ax.plot(x, [per_k[k]["ops_per_layer_varlen_off"] for k in ks], ":", color=color)
    ops_ax.set(
        xscale="log",
        yscale="log",
        xlabel="tenants K (one 64-token datum each)",
        ylabel="kernel ops per decoder layer (forward + backward)",
        title="ops per layer (dotted: VARLEN off, attention per row)",
    )
    ops_ax.set_xticks([int(k) for k in payload["config"]["tenants"]])
    lo, hi = ops_ax.get_ylim()
    ops_ax.set_yticks([t for t in (100, 200, 300, 500, 1000, 2000, 5000, 10000) if lo <= t <= hi])
    for axis in (ops_ax.xaxis, ops_ax.yaxis):
        axis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        axis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ops_ax.grid(alpha=0.3, which="both")
    ops_ax.legend(fontsize=8, ncol=2)  # llama and qwen2 count alike: one line
    # Casts per token at K = 8, by where they happen, and the total with bf16 LoRA GEMMs.
    k = str(VARIANT_K)
    names = list(families)
    y = list(range(len(names)))
    per_token = {
        region: [
            families[f][k]["regions"][region]["cast_bytes"] / families[f][k]["tokens"]
            for f in names
        ]
        for region in ("layer", "head_loss")
    }
    totals = [families[f][k]["cast_bytes_per_token"] for f in names]
    layer, head = per_token["layer"], per_token["head_loss"]
    rest = [t - a - b for t, a, b in zip(totals, layer, head, strict=True)]
    cast_ax.barh(y, per_token["layer"], color="C0", label="decoder layers")
    cast_ax.barh(
        y, per_token["head_loss"], left=per_token["layer"], color="C1", label="head + loss"
    )
    left = [a + b for a, b in zip(per_token["layer"], per_token["head_loss"], strict=True)]
    cast_ax.barh(y, rest, left=left, color="C7", label="elsewhere")
    variant = [
        families[f][k]["variants"]["lora_gemms_in_base_dtype"]["cast_bytes"]
        / families[f][k]["tokens"]
        for f in names
    ]
    cast_ax.plot(variant, y, "k|", markersize=16, mew=2, label="total, LoRA GEMMs in bf16")
    cast_ax.set_yticks(y, names)
    cast_ax.invert_yaxis()
    cast_ax.set(
        xlabel=f"bytes cast between dtypes per token at K = {k} (the same at every K)",
        title="dtype casts per token, by where they happen",
    )
    cast_ax.grid(alpha=0.3, axis="x")
    cast_ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=4)
    fig.suptitle("One packed cycle on CUDA's code paths, counted on a CPU (bf16 base weights)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--families", nargs="*", default=sorted(zoo.FAMILIES))
    p.add_argument("--tenants", nargs="*", type=int, default=[1, 8, 32])
    p.add_argument("--tokens", type=int, default=64, help="tokens of each tenant's one datum")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16", help="base weights (bf16: as on CUDA)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--name", default=NAME, help="results file stem (benchmarks/results/NAME.*)")
    p.add_argument("--data-dir", type=Path, default=None, help="tiny models (default: a temp dir)")
    args = p.parse_args()
    if sum(k > 1 for k in args.tenants) < 2 or VARIANT_K not in args.tenants:
        p.error(f"--tenants needs two counts above 1 (one tenant is no packing), {VARIANT_K} too")
    torch.set_num_threads(args.threads)
    families: dict[str, Any] = {}
    paths: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp, Progress() as progress:
        data_dir = args.data_dir or Path(tmp)
        runs = len(args.families) * (2 * len(args.tenants) + 1)
        task = progress.add_task("census", total=runs)
        for family in args.families:
            families[family], paths = census_family(family, args, data_dir, progress, task)
    payload = {
        "config": {
            "tenants": args.tenants,
            "tokens_per_tenant": args.tokens,
            "rank": args.rank,
            "dtype": args.dtype,
            "device": "cpu",
        },
        "paths": {
            **paths,
            "note": "CUDA's code paths chosen on the CPU (lockstep/modeling/cuda_paths.py); "
            "VARLEN attention through a stand-in kernel counted as one call; "
            "ops_per_layer_varlen_off: attention per row (VARLEN off, today's default)",
        },
        "environment": environment(),
        "families": families,
        "growth": {family: growth(per_k) for family, per_k in families.items()},
    }
    path = write_json(args.name, payload)
    rows = []
    for family, per_k in families.items():
        for k, s in per_k.items():
            rows.append(
                [
                    family if k == str(args.tenants[0]) else "",
                    k,
                    s["ops_per_layer"],
                    s["ops_per_layer_varlen_off"],
                    s["all_ops_per_layer"],
                    s["cast_bytes"] / 1e6,
                    s["cast_bytes_per_token"],
                    s["max_groups"],
                    s["regions"]["head_loss"]["kernel_ops"],
                    s["regions"]["optimizer"]["kernel_ops"],
                    s["host_reads_per_layer"],
                ]
            )
    print_table(
        "One packed cycle per family and K (CUDA's code paths on the CPU)",
        [
            "family",
            "K",
            "ops/layer",
            "varlen off",
            "all ops/layer",
            "cast MB",
            "cast B/token",
            "max groups",
            "head+loss ops",
            "optim ops",
            "host reads/layer",
        ],
        rows,
    )
    for family, g in payload["growth"].items():
        if g["ops_per_layer_grows"]:
            print(f"{family}: ops per layer grow with K: {'; '.join(g['where'])}")
    figure(payload, figure_path(args.name))
    print(f"wrote {path} and {figure_path(args.name)}")


if __name__ == "__main__":
    main()
