"""The headline table and the figure of a `gpu_suite.py` run, from its results alone (so a
results file from a GPU can be re-plotted anywhere: `python benchmarks/gpu_report.py FILE`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

FAMILIES = ("dense", "moe", "hybrid")
# Each family's MFU target: (the result it reads, the target's name in TARGETS).
MFU_TARGET = {
    "dense": ("lora_mfu", "dense_lora_mfu"),
    "moe": ("layer_stack_mfu", "moe_layer_stack_mfu"),
}


def _row(
    measure: str, value: Any, target: float | None = None, more: bool = True
) -> dict[str, Any]:
    met = None
    if target is not None and isinstance(value, float):
        met = value >= target if more else value <= target
    return {"measure": measure, "value": value, "target": target, "met": met}


def summary(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per headline number, with its target where the issue sets one."""
    sections, targets = results["sections"], results["targets"]
    rows = []
    for name, section in sections.items():
        if "error" in section or "skipped" in section:
            rows.append(
                _row(
                    f"{name}",
                    f"{'error' if 'error' in section else 'skipped'}: "
                    f"{section.get('error') or section.get('skipped')}"[:90],
                )
            )
    for family in FAMILIES:
        s = sections.get(family, {})
        if "packed_tokens_per_s" not in s:
            continue
        rows += _mfu_rows(family, s, targets, sections.get("device", {}))
        rows.append(_row(f"{family}: packed / one after another", s["packed_over_sequential"]))
        small = s.get("small_rows", {})
        size = f"{small.get('tenants')}x{small.get('row_tokens')}"
        rows.append(
            _row(
                f"{family}: {size} packed / one tenant, same tokens",
                small.get("packed_over_one_tenant_same_tokens"),
                targets["packed_over_one_tenant_same_tokens"],
            )
        )
        rows.append(
            _row(
                f"{family}: {size} packed / one tenant per cycle",
                small.get("packed_over_one_tenant_per_cycle"),
                targets["packed_over_one_tenant_per_cycle"],
            )
        )
        rows.append(_row(f"{family}: peak memory GB", s.get("peak_gpu_memory_gb")))
        variants = s.get("variants", {})
        base = variants.get("default", {}).get("packed_tokens_per_s")
        for name, label, faster_when_on in (
            ("chunked_head", "fused head speed-up", False),
            ("varlen_attention", "varlen attention speed-up", True),
            ("per_group_expert_matmul", "grouped experts speed-up", False),
            ("per_adapter_expert_lora", "grouped (adapter, expert) LoRA speed-up", False),
            ("lora_gemms_in_base_dtype", "bf16 grouped LoRA speed-up", True),
        ):
            v = variants.get(name, {})
            if base and "packed_tokens_per_s" in v:
                ratio = (
                    v["packed_tokens_per_s"] / base
                    if faster_when_on
                    else base / v["packed_tokens_per_s"]
                )
                rows.append(
                    _row(
                        f"{family}: {label} (logprob diff {v.get('max_abs_logprob_diff', 0):.1e})",
                        ratio,
                    )
                )
    return (
        rows
        + _fits_rows(sections, targets)
        + _sampler_rows(sections, targets)
        + _kernel_rows(sections)
    )


def _mfu_rows(
    family: str, s: dict[str, Any], targets: dict[str, Any], device: dict[str, Any]
) -> list[dict[str, Any]]:
    """MFU against the measured rate and the datasheet (whole, no attention FLOPs, the layer
    stack), and tokens/s; a family's MFU target also as the tokens/s it implies here."""
    read, name = MFU_TARGET.get(family, ("", ""))
    target = targets.get(name)
    rows = []
    for key, label in (
        ("lora_mfu", "LoRA-MFU, attention counted"),
        ("lora_mfu_no_attention", "LoRA-MFU, no attention FLOPs"),
        ("layer_stack_mfu", "layer-stack LoRA-MFU (head apart)"),
    ):
        rows.append(_row(f"{family}: {label}", s.get(key), target if key == read else None))
        rows.append(_row(f"{family}: {label}, datasheet peak", s.get(f"{key}_datasheet")))
    rows.append(_row(f"{family}: head share of FLOPs", s.get("head_flops_share")))
    implied = None
    rate = device.get("matmul_bf16_flops_per_s")
    flops = s.get("flops_per_token") if read == "lora_mfu" else None
    if target and rate and flops:
        implied = target * rate / flops
    tokens_target = targets.get(f"{family}_tokens_per_s")
    floor = max(filter(None, (implied, tokens_target)), default=None)
    rows.append(_row(f"{family}: packed tokens/s", s["packed_tokens_per_s"], floor))
    return rows


def _fits_rows(sections: dict[str, Any], targets: dict[str, Any]) -> list[dict[str, Any]]:
    fits = sections.get("fits", {})
    if "packed_tokens_per_s" not in fits:
        return []
    recomputed = f"{fits['recomputed_layers_per_full_micro_batch']}/{fits['layers']}"
    return [
        _row(
            f"fits: peak GiB under the {fits.get('limit_gib')} GiB limit "
            f"({recomputed} layers recomputed)",
            fits.get("peak_gpu_memory_gb"),
            targets["fits_peak_gib"],
            more=False,
        ),
        _row(
            "fits: tokens/s over the unconstrained run",
            fits.get("over_unconstrained"),
            targets["fits_over_unconstrained"],
        ),
    ]


def _kernel_rows(sections: dict[str, Any]) -> list[dict[str, Any]]:
    """The single-kernel sections' rows: the replaced path's time over the fast path's."""
    rows = []
    head = sections.get("head", {})
    for case in ("no_head_lora", "head_lora"):
        if case in head:
            c = head[case]
            rows.append(
                _row(
                    f"head ({case}): chunked / fused time "
                    f"(grad diff {c['max_abs_diff_hidden_grad']:.1e})",
                    c["chunked_over_fused_time"],
                )
            )
    for name, case in sections.get("experts", {}).items():
        if isinstance(case, dict) and "per_adapter_over_grouped_time" in case:
            rows.append(
                _row(
                    f"experts {name}: per-adapter / grouped LoRA time "
                    f"(out diff {case['max_abs_diff_out']:.1e})",
                    case["per_adapter_over_grouped_time"],
                )
            )
    for name, case in sections.get("attention", {}).items():
        if isinstance(case, dict) and "rows_over_varlen_time" in case:
            rows.append(
                _row(
                    f"attention {name}: row loop / varlen time "
                    f"(out diff {case['max_abs_diff_out']:.1e})",
                    case["rows_over_varlen_time"],
                )
            )
    return rows


def _sampler_rows(sections: dict[str, Any], targets: dict[str, Any]) -> list[dict[str, Any]]:
    """Each family's sampler section (its trainer section may be absent)."""
    rows = []
    for family in FAMILIES:
        sampler = sections.get(f"{family}_sampler", {})
        if "tokens_per_s" in sampler:
            rows.append(
                _row(
                    f"{family}: today's local sampler, generated tokens/s", sampler["tokens_per_s"]
                )
            )
        if "speedup" in sampler:
            static = sampler["variants"]["static_auto"]
            agree = sampler["static_vs_eager"]
            how = f"{static['dtype']} {static['decode']}, graphs {static['cuda_graphs']}"
            rows.append(
                _row(f"{family}: sampler ({how}), generated tokens/s", static["tokens_per_s"])
            )
            roofline = sampler.get("roofline", {})
            rows.append(
                _row(
                    f"{family}: sampler share of the HBM roofline at 32 sequences",
                    roofline.get("roofline_share"),
                    targets.get("sampler_roofline_share"),
                )
            )
            rows.append(
                _row(
                    f"{family}: sampler / today's local sampler (same tokens "
                    f"{agree['same_tokens_share']:.2f}, logprob diff "
                    f"{agree['max_abs_logprob_diff']:.1e})",
                    sampler["speedup"],
                )
            )
    return rows


def figure(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sections = results["sections"]
    trained = [f for f in FAMILIES if "packed_tokens_per_s" in sections.get(f, {})]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    ax = axes[0][0]
    for i, family in enumerate(trained):
        s = sections[family]
        ax.bar(
            i - 0.2,
            s.get("lora_mfu") or 0,
            0.4,
            color="tab:blue",
            label="attention counted" if not i else None,
        )
        ax.bar(
            i + 0.2,
            s.get("lora_mfu_no_attention") or 0,
            0.4,
            color="tab:cyan",
            label="no attention" if not i else None,
        )
        target = results["targets"].get(MFU_TARGET.get(family, ("", ""))[1])
        if target and MFU_TARGET[family][0] == "lora_mfu":
            ax.hlines(target, i - 0.4, i + 0.4, colors="red", linestyles="--")
    ax.set_xticks(range(len(trained)), trained)
    ax.set_title("LoRA-MFU on active parameters (red: target)")
    ax.legend()
    ax = axes[0][1]
    keys = (
        "packed_over_sequential",
        "packed_over_one_tenant_same_tokens",
        "packed_over_one_tenant_per_cycle",
    )
    for j, key in enumerate(keys):
        values = [
            sections[f].get(key) or sections[f].get("small_rows", {}).get(key) or 0 for f in trained
        ]
        ax.bar(
            [i + (j - 1) * 0.27 for i in range(len(trained))],
            values,
            0.27,
            label=key.replace("_", " "),
        )
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks(range(len(trained)), trained)
    ax.set_title("packing (8 x 2048 and 8 x 256 tokens)")
    ax.legend(fontsize=7)
    ax = axes[1][0]
    for i, family in enumerate(trained):
        ax.bar(
            i - 0.2,
            sections[family]["packed_tokens_per_s"],
            0.2,
            color="tab:blue",
            label="trainer" if not i else None,
        )
        sampler = sections.get(f"{family}_sampler", {})
        ax.bar(
            i,
            sampler.get("tokens_per_s", 0),
            0.2,
            color="tab:orange",
            label="sampler (today)" if not i else None,
        )
        static = sampler.get("variants", {}).get("static_auto", {})
        ax.bar(
            i + 0.2,
            static.get("tokens_per_s", 0),
            0.2,
            color="tab:red",
            label="sampler (bf16, static decode)" if not i else None,
        )
    ax.set_yscale("log")
    ax.set_xticks(range(len(trained)), trained)
    ax.set_title("tokens/s: trainer (packed) vs local sampler (generated)")
    ax.legend()
    ax = axes[1][1]
    labels, values = [], []
    for row in summary(results):
        if "speed-up" in row["measure"] or "time (" in row["measure"]:
            if isinstance(row["value"], float):
                labels.append(row["measure"].split(" (")[0])
                values.append(row["value"])
    ax.barh(range(len(values)), values, color="tab:green")
    ax.set_yticks(range(len(values)), labels, fontsize=7)
    ax.axvline(1.0, color="gray", lw=0.8)
    ax.set_title("kernel speed-ups (> 1: the fast path is faster)")
    env = results.get("environment", {})
    fig.suptitle(
        f"gpu_suite ({results.get('mode')}) on {sections.get('device', {}).get('name', '?')}, "
        f"rev {env.get('git_rev', '?')}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    source = Path(sys.argv[1])
    loaded = json.loads(source.read_text())
    figure(loaded, source.with_suffix(".png"))
    for r in summary(loaded):
        print(f"{r['measure']:<80} {r['value']!s:>14} {r['target']!s:>8} {r['met']}")
