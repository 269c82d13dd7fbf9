"""Every GPU measurement of the project in one command (<= 8 minutes on one H100; `--quick` <= 3).

    python benchmarks/gpu_suite.py [--quick] [--profile] [--sections dense moe ...] [--out DIR]
    python benchmarks/gpu_suite.py --smoke        # tiny shapes, seconds, on a CPU: tests the script

Models are built in memory from configs (random init, bf16; `gpu_models.py`: Qwen3-8B,
Qwen3-30B-A3B and Qwen3.6-35B-A3B shapes, a few full-width layers, real vocabularies). Sections,
each guarded (one that fails records its error and the others still run; the JSON is written
after every section):

  device           the measured bf16 matmul rate and copy bandwidth (the MFU denominators)
  dense, moe,      the local trainer, 8 tenants x 4 datums x 512 tokens, LoRA rank 32 on every
  hybrid           linear layer / expert and the head: ONE packed cycle (run_passes + optim_step)
                   vs the tenants one after another; tokens/s, LoRA-MFU on active parameters with
                   and without attention FLOPs, peak memory, the admission formula vs the measured
                   peak; 8 tenants x 256 tokens packed vs ONE tenant with the same tokens vs one
                   tenant per cycle; the kernel variants (fused head off, varlen attention on,
                   bf16 grouped LoRA GEMMs, per-group expert matmuls, per-adapter expert LoRA)
                   in the same run: tokens/s and logprob difference
  *_sampler        the local sampler on the same model (an adapter from the trainer): generated
                   tokens/s beside the trainer's, today's fp32 eager decode vs bf16 weights and
                   the static-KV decode (CUDA graphs where the family allows), and whether the
                   static decode samples what the eager one does (`gpu_sampler.py`)
  head, attention, single kernels at production shape (`gpu_kernels.py`; the hybrid layers'
  experts,         kernels, fla against the PyTorch reference: `gpu_hybrid.py`)
  hybrid_kernels

`--profile` writes the top kernels of one packed cycle per family (`gpu_suite_profile.txt`).
Results: `gpu_suite.json` / `.png` under `--out` (default benchmarks/results); `--rev` names the
commit measured when the tree has no git metadata (a copied working tree).
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from common import RESULTS_DIR, environment, print_table
from gpu_hybrid import hybrid_kernels_section
from gpu_kernels import attention_section, experts_section, head, varlen_runs
from gpu_models import (
    RANK,
    SHAPES,
    SMOKE,
    Shape,
    admission,
    build_model,
    copy_bandwidth,
    cycle,
    data,
    flops_per_token,
    forward_logprobs,
    matmul_rate,
    peak_gb,
    profile_cycle,
    reset_peak,
)
from gpu_sampler import sample_throughput
from rich.console import Console

from lockstep.engine.types import LoraSpec
from lockstep.modeling import attention, experts, grouped_gemm, linear_lora
from lockstep.training import logprobs
from lockstep.workers.local.trainer import LocalTrainingEngine

NAME = "gpu_suite"
TARGETS = {
    "moe_lora_mfu": 0.25,  # on active parameters, attention FLOPs counted
    "dense_lora_mfu": 0.40,
    "packed_over_one_tenant_same_tokens": 0.9,  # 8 tenants x 256 tokens
    "packed_over_one_tenant_per_cycle": 3.0,
    "sampler_over_todays_local_sampler": 5.0,
}
DATASHEET_BF16 = {"H100": 989.4e12, "H200": 989.4e12}  # dense bf16, SXM
console = Console(width=150, log_path=False)


class Run:
    """The run's settings, its clock, its results and where they go."""

    def __init__(self, args: argparse.Namespace, device: str) -> None:
        self.args, self.device = args, device
        self.smoke, self.quick = args.smoke, args.quick
        self.start = time.perf_counter()
        self.budget = args.budget or (1e9 if self.smoke else 170.0 if self.quick else 460.0)
        self.reps = 1 if self.smoke else 2 if self.quick else 3
        self.tenants = 2 if self.smoke else 8
        self.warm = 0 if self.smoke else 1  # untimed warm-up reps (the smoke run times none)
        # bf16 base weights on the GPU (the CUDA default); fp32 on a CPU smoke run, where bf16
        # GEMMs take slow paths
        self.dtype = "bfloat16" if device == "cuda" else "float32"
        self.datums, self.length = (2, 32) if self.smoke else (4, 512)
        self.small_length = 16 if self.smoke else 256
        self.micro_batch_tokens = 256 if self.smoke else 8192
        self.out = Path(args.out)
        self.results: dict[str, Any] = {"sections": {}}
        self.profiles: list[str] = []
        self.models: dict[str, Path] = {}
        self.adapters: dict[str, Path] = {}
        self.tmp = Path(tempfile.mkdtemp(prefix="gpu-suite-"))

    def left(self) -> float:
        return self.budget - (time.perf_counter() - self.start)

    def out_of_time(self) -> bool:
        """Past the budget but for a margin: measuring loops stop after their first sample."""
        return self.left() < 20

    def shape(self, family: str) -> Shape:
        if self.smoke:
            return SMOKE[family]
        layers = {"dense": 4, "moe": 2}.get(family) if self.quick else None
        shape = SHAPES[family]
        return shape.with_layers(layers) if layers else shape

    def model(self, family: str) -> Path:
        """The family's model directory, built on first use (kept for its sampler section)."""
        if family not in self.models:
            directory = self.tmp / family
            shape = self.shape(family)
            console.log(f"{family}: building {shape.title} x {shape.layers} layers")
            build_model(directory, shape, self.device)
            self.models[family] = directory
        return self.models[family]

    def save(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        path = self.out / f"{self.args.name}.json"
        path.write_text(json.dumps(self.results, indent=2, default=_plain) + "\n")
        if self.profiles:
            (self.out / f"{self.args.name}_profile.txt").write_text("\n\n".join(self.profiles))


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor | np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return str(value)


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


def trainer_section(run: Run, family: str) -> dict[str, Any]:
    directory = run.model(family)
    shape = run.shape(family)
    engine = LocalTrainingEngine(
        directory,
        shape.title,
        device=run.device,
        micro_batch_tokens=run.micro_batch_tokens,
        dtype=run.dtype,
    )
    try:
        return _measure_trainer(run, family, engine, shape)
    finally:
        engine.close()
        del engine
        _release(run.device)


def _measure_trainer(
    run: Run, family: str, engine: LocalTrainingEngine, shape: Shape
) -> dict[str, Any]:
    names = [f"t{i}" for i in range(run.tenants)]
    for i, t in enumerate(names):
        engine.create_model(t, LoraSpec(rank=RANK, alpha=32.0, seed=i))
    per = {t: data(i, shape.vocab, run.datums, run.length) for i, t in enumerate(names)}
    tokens = run.tenants * run.datums * run.length
    out: dict[str, Any] = {
        "shape": {"title": shape.title, "layers": shape.layers, **shape.settings},
        "tenants": run.tenants,
        "datums_per_tenant": run.datums,
        "datum_tokens": run.length,
        "rank": RANK,
        "micro_batch_tokens": run.micro_batch_tokens,
        **flops_per_token(engine, run.length),
    }
    cycle(engine, per, run.device, lr=1e-3)  # warm-up; moves B off zero: every LoRA term counts
    out["variants"] = _variants(run, family, engine, per)
    reset_peak(run.device)
    packed, sequential = [], []
    for rep in range(run.reps + run.warm):  # rep 0 warms up; modes interleaved rep by rep
        tp = cycle(engine, per, run.device)
        ts = sum(cycle(engine, {t: per[t]}, run.device) for t in names)
        console.log(f"{family}: rep {rep}: packed {tp:.3f} s, sequential {ts:.3f} s")
        if rep >= run.warm:
            packed.append(tp)
            sequential.append(ts)
        if run.out_of_time() and packed:
            break
    out["peak_gpu_memory_gb"] = peak_gb(run.device)
    out["packed_s"], out["sequential_s"] = packed, sequential
    tp, ts = statistics.median(packed), statistics.median(sequential)
    out["packed_tokens_per_s"] = tokens / tp
    out["sequential_tokens_per_s"] = tokens / ts
    out["packed_over_sequential"] = ts / tp
    rate = run.results["sections"].get("device", {}).get("matmul_bf16_flops_per_s")
    if rate:
        out["lora_mfu"] = tokens / tp * out["flops_per_token"] / rate
        out["lora_mfu_no_attention"] = tokens / tp * out["flops_per_token_no_attention"] / rate
    out["small_rows"] = _small_rows(run, family, engine, names, shape)
    out["admission"] = _guarded(lambda: admission(engine, per, run.length, run.device))
    if run.args.profile:
        table = profile_cycle(engine, per, run.device)
        size = f"{run.tenants} tenants x {run.datums} x {run.length} tokens"
        run.profiles.append(f"== {family}: one packed cycle, {size}\n{table}")
    snapshot = run.tmp / f"{family}-snapshot"
    start = time.perf_counter()
    out["snapshot_bytes_per_tenant"] = engine.save_state("t0", snapshot, include_optimizer=True)
    out["snapshot_s_per_tenant"] = time.perf_counter() - start  # adapter + Adam moments
    adapter = run.tmp / f"{family}-adapter"
    engine.export_adapter("t0", adapter)
    run.adapters[family] = adapter
    return out


def _switches(
    run: Run, family: str, engine: LocalTrainingEngine
) -> dict[str, Callable[[bool], None]]:
    """The kernel switches that change something for this family on this device."""
    switches: dict[str, Callable[[bool], None]] = {
        "chunked_head": lambda on: setattr(logprobs, "FUSED_HEAD", not on),
    }
    if varlen_runs(run.device, engine._model.dtype):
        switches["varlen_attention"] = lambda on: setattr(attention, "VARLEN", on)
    if engine._model.dtype != torch.float32:  # the grouped LoRA GEMMs in bf16, as the experts'
        switches["lora_gemms_in_base_dtype"] = lambda on: setattr(
            linear_lora, "GROUPED_IN_BASE_DTYPE", on
        )
    if family == "moe" and not run.quick:  # (the hybrid's own layers dominate its time)
        switches["per_group_expert_matmul"] = lambda on: setattr(
            grouped_gemm, "GROUPED_KERNEL", not on
        )
        switches["per_adapter_expert_lora"] = lambda on: setattr(
            experts, "GROUPED_ADAPTERS", not on
        )
    return switches


def _variants(
    run: Run, family: str, engine: LocalTrainingEngine, per: dict[str, Any]
) -> dict[str, Any]:
    """Each kernel switch against the default path in the same run: packed tokens/s (cycles
    interleaved rep by rep) and the largest logprob difference of one forward-only pass."""
    switches = _switches(run, family, engine)
    reference = forward_logprobs(engine, per)
    out: dict[str, Any] = {}
    for name, switch in switches.items():
        switch(True)
        try:
            diff = np.abs(forward_logprobs(engine, per) - reference).max()
            out[name] = {"max_abs_logprob_diff": float(diff)}
        except Exception as exc:  # a kernel this device lacks: recorded, not fatal
            out[name] = {"error": repr(exc)}
        finally:
            switch(False)
    timed = {
        "default": lambda on: None,
        **{n: f for n, f in switches.items() if "error" not in out[n]},
    }
    times: dict[str, list[float]] = {n: [] for n in timed}
    reps = 1 if family == "moe" and not run.smoke else run.reps  # the slow variant bounds it
    for rep in range(reps + run.warm):
        for name, switch in timed.items():
            switch(True)
            try:
                seconds = cycle(engine, per, run.device)
            finally:
                switch(False)
            if rep >= run.warm:
                times[name].append(seconds)
        if run.out_of_time() and times["default"]:
            break
    tokens = sum(len(d.tokens) for rows in per.values() for d in rows)
    for name in timed:
        out.setdefault(name, {})["packed_tokens_per_s"] = tokens / statistics.median(times[name])
        out[name]["packed_s"] = times[name]
    rates = ", ".join(f"{n} {out[n]['packed_tokens_per_s']:.0f} tok/s" for n in timed)
    console.log(f"{family} variants: {rates}")
    return out


def _small_rows(
    run: Run, family: str, engine: LocalTrainingEngine, names: list[str], shape: Shape
) -> dict[str, Any]:
    """8 tenants x 1 datum x 256 tokens: ONE packed cycle vs ONE tenant with the same 8 datums
    vs one tenant per cycle (8 cycles), modes interleaved rep by rep."""
    rows = {t: data(100 + i, shape.vocab, 1, run.small_length) for i, t in enumerate(names)}
    together = [d for t in names for d in rows[t]]
    times: dict[str, list[float]] = {
        "packed": [],
        "one_tenant_same_tokens": [],
        "one_tenant_per_cycle": [],
    }
    for rep in range(run.reps + run.warm):
        packed = cycle(engine, rows, run.device)
        alone = cycle(engine, {names[0]: together}, run.device)
        serial = sum(cycle(engine, {t: rows[t]}, run.device) for t in names)
        if rep >= run.warm:
            times["packed"].append(packed)
            times["one_tenant_same_tokens"].append(alone)
            times["one_tenant_per_cycle"].append(serial)
        if run.out_of_time() and times["packed"]:
            break
    tokens = run.tenants * run.small_length
    med = {k: statistics.median(v) for k, v in times.items()}
    out = {f"{k}_s": v for k, v in times.items()}
    out.update({f"{k}_tokens_per_s": tokens / v for k, v in med.items()})
    out["packed_over_one_tenant_same_tokens"] = med["one_tenant_same_tokens"] / med["packed"]
    out["packed_over_one_tenant_per_cycle"] = med["one_tenant_per_cycle"] / med["packed"]
    same, serial = (out[f"packed_over_one_tenant_{k}"] for k in ("same_tokens", "per_cycle"))
    out["tenants"], out["row_tokens"] = run.tenants, run.small_length
    size = f"{run.tenants} x {run.small_length}"
    console.log(f"{family}: {size}: packed/one-tenant {same:.2f}, /per-cycle {serial:.2f}")
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
        _release(run.device)
    out["peak_gpu_memory_gb"] = peak_gb(run.device)
    out["trainer_packed_tokens_per_s"] = (
        run.results["sections"].get(family, {}).get("packed_tokens_per_s")
    )
    static = out["variants"]["static_auto"]
    console.log(
        f"{family} sampler: {out['tokens_per_s']:.0f} generated tok/s fp32 eager, "
        f"{static['tokens_per_s']:.0f} {static['dtype']} {static['decode']} "
        f"(graphs {static['cuda_graphs']}): x{out['speedup']:.2f}"
    )
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
        _release(run.device)


def _release(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def _guarded(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    try:
        return fn()
    except Exception as exc:
        return {"error": repr(exc), "traceback": traceback.format_exc(limit=6)}


# -- the run ----------------------------------------------------------------------------------

Section = tuple[str, Callable[[Run], dict[str, Any]], float]  # name, body, full-run estimate (s)
SECTIONS: list[Section] = [
    ("device", device_section, 10),
    ("dense", lambda r: trainer_section(r, "dense"), 100),
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
QUICK_SKIPS = {"hybrid", "oom_retry", "hybrid_sampler"}


def main() -> None:
    from gpu_report import figure, summary

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a <= 3-minute subset")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on any device, seconds")
    p.add_argument("--profile", action="store_true", help="top kernels of one cycle per family")
    p.add_argument("--sections", nargs="*", default=None, help=f"of {[s[0] for s in SECTIONS]}")
    p.add_argument("--device", default=None, help="default: cuda when present, else cpu")
    p.add_argument("--budget", type=float, default=None, help="seconds (default 460, quick 170)")
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
        result = _guarded(lambda body=body: body(run))
        result["section_s"] = time.perf_counter() - started
        if "error" in result:
            console.log(f"{name}: FAILED: {result['error']}")
            _release(run.device)
        run.results["sections"][name] = result
        run.save()


if __name__ == "__main__":
    main()
