"""Every GPU measurement of the project in one command (<= 5 minutes on one H200; `--quick` <= 3).

    python benchmarks/gpu_suite.py [--quick] [--profile] [--sections dense moe ...] [--out DIR]
    python benchmarks/gpu_suite.py --smoke        # tiny shapes, seconds, on a CPU: tests the script

Models are built from configs (random init, bf16; `gpu_models.py`: Qwen3-8B at full depth,
Qwen3-30B-A3B and Qwen3.6-35B-A3B shapes of 8 full-width layers, real vocabularies). Sections,
each guarded (one that fails records its error and the others still run; the JSON is written
after every section; a failed section makes the suite exit 1):

  device           the measured bf16 matmul rate and copy bandwidth (the MFU denominators) and the
                   datasheet's bf16 peak (the field's convention)
  compat           every family of the zoo trains under the lowest and the highest transformers
                   release (the image's own and the carried one), and 8 tenants of a 256-expert
                   MoE (2048 (adapter, expert) groups: over CUDA's grouped-GEMM limit) equal a
                   tenant alone (`gpu_compat.py`)
  dense, moe,      the local trainer (`gpu_trainer.py`): tokens/s, LoRA-MFU (measured rate and
  hybrid           datasheet; whole and layer stack), peak memory, packing ratios, kernel variants
  fits             the dense family with the whole process under 40 GiB (activation checkpointing
                   chosen by admission): peak and throughput over the unconstrained run
  *_sampler        the local sampler on the same model (an adapter from the trainer): generated
                   tokens/s, today's fp32 eager decode vs bf16 weights and the static-KV decode
                   (CUDA graphs where the family allows), the share of the HBM roofline at 32
                   sequences (`gpu_sampler.py`)
  head, attention, single kernels at production shape (`gpu_kernels.py`; the hybrid layers'
  experts,         kernels, fla against the PyTorch reference: `gpu_hybrid.py`)
  hybrid_kernels

The targets (`TARGETS`) are checked in the summary: each MFU target also as tokens/s (the rate
it implies on this GPU), so a target is met on the measured rate and in tokens/s. The JSON names
the commit, torch, transformers and the kernel libraries. `--profile` writes the top kernels of
one packed cycle per family (`gpu_suite_profile.txt`). Results: `gpu_suite.json` / `.png` under
`--out` (default benchmarks/results); `--rev` names the commit measured when the tree has no git
metadata (a copied working tree).
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import shutil
import time
from collections.abc import Callable
from typing import Any

import torch
from common import RESULTS_DIR, environment, print_table
from gpu_hybrid import hybrid_kernels_section
from gpu_kernels import attention_section, experts_section, head
from gpu_models import RANK, copy_bandwidth, data, matmul_rate, peak_gb, reset_peak
from gpu_run import Run, console, guarded, release
from gpu_sampler import decode_roofline, sample_throughput
from gpu_trainer import fits_section, trainer_section

from lockstep.engine.types import LoraSpec
from lockstep.workers.local.trainer import LocalTrainingEngine

NAME = "gpu_suite"
TARGETS = {
    # LoRA-MFU on active parameters, attention FLOPs counted, against the measured matmul rate
    "dense_lora_mfu": 0.45,
    "dense_tokens_per_s": 11_500.0,
    "moe_layer_stack_mfu": 0.25,  # the head's FLOPs and time set apart
    "packed_over_one_tenant_same_tokens": 0.9,  # 8 tenants x 256 tokens
    "packed_over_one_tenant_per_cycle": 3.0,
    "fits_peak_gib": 40.0,  # at most
    "fits_over_unconstrained": 0.75,  # at least
    "sampler_roofline_share": 0.5,  # decode at 32 sequences
}
DATASHEET_BF16 = {"H100": 989.4e12, "H200": 989.4e12}  # dense bf16, SXM


# -- sections ---------------------------------------------------------------------------------


def device_section(run: Run) -> dict[str, Any]:
    name = torch.cuda.get_device_name() if run.device == "cuda" else run.device
    rate = matmul_rate(run.device)
    sheet = next((v for k, v in DATASHEET_BF16.items() if k in name), None)
    out = {
        "name": name,
        "matmul_bf16_flops_per_s": rate,
        "copy_bytes_per_s": copy_bandwidth(run.device),
        "datasheet_bf16_flops_per_s": sheet,
    }
    if run.device == "cuda":
        out["memory_gb"] = torch.cuda.get_device_properties(0).total_memory / 1024**3
    console.log(f"device: {name}: {rate / 1e12:.0f} TFLOP/s bf16 matmul")
    return out


def sampler_section(run: Run, family: str) -> dict[str, Any]:
    """The local sampler's ways of running on the family's model, with the adapter its trainer
    exported (`gpu_sampler.py`)."""
    shape = run.shape(family)
    reset_peak(run.device)
    try:
        out = sample_throughput(
            run.device,
            run.model(family),
            shape.title,
            min(shape.vocab, 1 << 14),
            run.adapters.get(family),
            new_tokens=8 if run.smoke else 64 if run.quick else 128,
            prompt_tokens=16 if run.smoke else 128,
            reps=max(1, run.reps - 1),
        )
    finally:
        release(run.device)
    out["peak_gpu_memory_gb"] = peak_gb(run.device)
    out["trainer_packed_tokens_per_s"] = (
        run.results["sections"].get(family, {}).get("packed_tokens_per_s")
    )
    static = out["variants"]["static_auto"]
    bandwidth = run.results["sections"].get("device", {}).get("copy_bytes_per_s")
    if bandwidth:
        sequences = out["requests"] * out["samples_per_request"]
        context = out["prompt_tokens"] + out["new_tokens"] / 2
        roofline = decode_roofline(run.model(family), sequences, context, bandwidth)
        roofline["roofline_share"] = static["tokens_per_s"] / roofline["roofline_tokens_per_s"]
        out["roofline"] = roofline
    console.log(
        f"{family} sampler: {out['tokens_per_s']:.0f} generated tok/s fp32 eager, "
        f"{static['tokens_per_s']:.0f} {static['dtype']} {static['decode']} "
        f"(graphs {static['cuda_graphs']}): x{out['speedup']:.2f}"
    )
    return out


def compat(run: Run) -> dict[str, Any]:
    """Every family loads and trains under the lowest and the highest transformers release
    (`gpu_compat.py`); a family that fails either fails the section."""
    from gpu_compat import compat_section, failures

    out = compat_section(run.device, run.smoke)
    failed = failures(out)
    if failed:
        out["error"] = "; ".join(failed)[:2000]
    return out


def oom_retry_section(run: Run) -> dict[str, Any]:
    """A pass that runs out of CUDA memory is retried in halved micro-batches
    (`oom_retry_gpu.py`, bf16): both peaks, the retries, how far the numbers moved."""
    if run.device != "cuda":
        return {"skipped": "needs CUDA (set_per_process_memory_fraction)"}
    from oom_retry_gpu import retried

    shape = run.shape("moe")
    names = [f"t{i}" for i in range(run.tenants)]
    per = {t: data(i, shape.vocab, run.datums, run.length) for i, t in enumerate(names)}
    tokens = run.tenants * run.datums * run.length
    engine = LocalTrainingEngine(
        run.model("moe"), shape.title, device="cuda", micro_batch_tokens=tokens, dtype="bfloat16"
    )
    try:
        for i, t in enumerate(names):
            engine.create_model(t, LoraSpec(rank=RANK, alpha=32.0, seed=i))
        out = retried(engine, names, per)
        return {
            "micro_batch_tokens": tokens,
            **{k: v for k, v in out.items() if k != "retries_logged"},
            "retries": len(out["retries_logged"]),
        }
    finally:
        engine.close()
        del engine
        release(run.device)


# -- the run ----------------------------------------------------------------------------------

Section = tuple[str, Callable[[Run], dict[str, Any]], float]  # name, body, full-run estimate (s)
SECTIONS: list[Section] = [
    ("device", device_section, 10),
    ("compat", compat, 40),
    ("dense", lambda r: trainer_section(r, "dense"), 100),
    ("fits", fits_section, 40),
    ("moe", lambda r: trainer_section(r, "moe"), 110),
    ("dense_sampler", lambda r: sampler_section(r, "dense"), 50),
    ("moe_sampler", lambda r: sampler_section(r, "moe"), 50),
    ("head", lambda r: head(r.device, r.smoke, r.reps), 20),
    ("attention", lambda r: attention_section(r.device, r.smoke, r.reps), 20),
    ("experts", lambda r: experts_section(r.device, r.smoke, r.reps), 20),
    ("hybrid_kernels", lambda r: hybrid_kernels_section(r.device, r.smoke, r.reps), 30),
    ("hybrid", lambda r: trainer_section(r, "hybrid"), 90),
    ("oom_retry", oom_retry_section, 40),
    ("hybrid_sampler", lambda r: sampler_section(r, "hybrid"), 50),
]
QUICK_SKIPS = {"hybrid", "oom_retry", "hybrid_sampler", "fits"}
# The libraries the numbers depend on, named in the JSON (absent: not installed).
LIBRARIES = (
    "torch",
    "transformers",
    "triton",
    "fla-core",
    "flash-linear-attention",
    "liger-kernel",
)


def main() -> None:
    from gpu_report import figure, summary

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a <= 3-minute subset")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on any device, seconds")
    p.add_argument("--profile", action="store_true", help="top kernels of one cycle per family")
    p.add_argument("--sections", nargs="*", default=None, help=f"of {[s[0] for s in SECTIONS]}")
    p.add_argument("--device", default=None, help="default: cuda when present, else cpu")
    p.add_argument("--budget", type=float, default=None, help="seconds (default 300, quick 170)")
    p.add_argument("--out", default=str(RESULTS_DIR))
    p.add_argument("--name", default=NAME)
    p.add_argument("--rev", default="", help="the commit measured, when the tree has no .git")
    args = p.parse_args()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu" and not args.smoke:
        raise SystemExit("the full suite needs a CUDA device (--smoke runs tiny shapes anywhere)")
    run = Run(args, device)
    env = environment()
    env["git_rev"] = env["git_rev"] or args.rev
    env["libraries"] = _versions()
    mode = "smoke" if run.smoke else "quick" if run.quick else "full"
    run.results.update(
        {
            "environment": env,
            "mode": mode,
            "device": device,
            "budget_s": run.budget,
            "targets": TARGETS,
        }
    )
    try:
        _run_sections(run)
    finally:
        shutil.rmtree(run.tmp, ignore_errors=True)
    run.results["elapsed_s"] = time.perf_counter() - run.start
    rows = summary(run.results)
    run.results["summary"] = rows
    run.save()
    try:
        figure(run.results, run.out / f"{args.name}.png")
    except ImportError as exc:  # matplotlib comes with the [bench] extra
        console.log(f"no figure written: {exc}")
    print_table(
        f"gpu_suite ({mode}, {device}, {run.results['elapsed_s']:.0f} s)",
        ["measure", "value", "target", "met"],
        [[r["measure"], r["value"], r["target"], r["met"]] for r in rows],
    )
    failed = [n for n, s in run.results["sections"].items() if "error" in s]
    if failed:
        raise SystemExit(f"failed sections: {', '.join(failed)}")


def _versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {}
    for name in LIBRARIES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    import transformers  # a carried wheel shadows the installed one: what is imported counts

    found["transformers"] = transformers.__version__
    found["torch"] = torch.__version__
    return found


def _run_sections(run: Run) -> None:
    args = run.args
    chosen = [s for s in SECTIONS if args.sections is None or s[0] in args.sections]
    for name, body, estimate in chosen:
        if run.quick and name in QUICK_SKIPS and args.sections is None:
            continue
        need = estimate * (0.5 if run.quick else 1.0) if not run.smoke else 0.0
        if run.left() < need:
            run.results["sections"][name] = {"skipped": f"{run.left():.0f} s left of the budget"}
            console.log(f"{name}: skipped: over the time budget")
            continue
        console.log(f"== {name} ({run.left():.0f} s left)")
        started = time.perf_counter()
        result = guarded(functools.partial(body, run))
        result["section_s"] = time.perf_counter() - started
        if "error" in result:
            console.log(f"{name}: FAILED: {result['error']}")
            release(run.device)
        run.results["sections"][name] = result
        run.save()


if __name__ == "__main__":
    main()
