"""The trainer sections of `gpu_suite.py` (dense, moe, hybrid) and `fits`.

A family's section: 8 tenants x 4 datums x 512 tokens, LoRA rank 32 on every linear layer /
expert and the head: ONE packed cycle (run_passes + optim_step) vs the tenants one after another;
tokens/s; LoRA-MFU on active parameters against the measured bf16 matmul rate and against the
datasheet, with and without attention FLOPs, and of the layer stack alone (the LM head's FLOPs
and its measured time set apart: in a model of a few layers the head is most of the work);
peak memory; the admission formula vs the measured peak; 8 tenants x 256 tokens packed vs ONE
tenant with the same tokens vs one tenant per cycle; the kernel variants in the same run.

`fits`: the dense family again under a memory budget that keeps the whole process under 40 GiB
of GPU memory (`--activation-checkpointing auto` recomputes the layers it must): its peak and its
throughput over the unconstrained run's.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from gpu_kernels import varlen_runs
from gpu_models import (
    RANK,
    Shape,
    admission,
    cycle,
    data,
    flops_per_token,
    forward_logprobs,
    head_seconds,
    peak_gb,
    profile_cycle,
    reset_peak,
)
from gpu_run import Run, console, guarded, release

from lockstep.engine.types import LoraSpec
from lockstep.modeling import attention, experts, grouped_gemm, linear_lora
from lockstep.training import logprobs
from lockstep.workers.local.trainer import LocalTrainingEngine

FITS_GIB = 40.0  # the whole process's GPU memory the `fits` section keeps under
ADAPTER_COPIES = 4  # fp32 parameters, gradients and Adam's two moments


def trainer_section(run: Run, family: str) -> dict[str, Any]:
    engine = _engine(run, family)
    try:
        return _measure_trainer(run, family, engine, run.shape(family))
    finally:
        engine.close()
        del engine
        release(run.device)


def _engine(run: Run, family: str, memory_budget_bytes: int = 0) -> LocalTrainingEngine:
    return LocalTrainingEngine(
        run.model(family),
        run.shape(family).title,
        device=run.device,
        micro_batch_tokens=run.micro_batch_tokens,
        dtype=run.dtype,
        memory_budget_bytes=memory_budget_bytes,
    )


def _tenants(
    run: Run, engine: LocalTrainingEngine, shape: Shape
) -> tuple[list[str], dict[str, Any]]:
    names = [f"t{i}" for i in range(run.tenants)]
    for i, t in enumerate(names):
        engine.create_model(t, LoraSpec(rank=RANK, alpha=32.0, seed=i))
    per = {t: data(i, shape.vocab, run.datums, run.length) for i, t in enumerate(names)}
    return names, per


def _measure_trainer(
    run: Run, family: str, engine: LocalTrainingEngine, shape: Shape
) -> dict[str, Any]:
    names, per = _tenants(run, engine, shape)
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
    out["head_s"] = head_seconds(engine, per, run.device, run.reps)
    out.update(_mfu(run, out, tokens, tp))
    out["small_rows"] = _small_rows(run, family, engine, names, shape)
    out["admission"] = guarded(lambda: admission(engine, per, run.length, run.device))
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


def _mfu(run: Run, out: dict[str, Any], tokens: int, seconds: float) -> dict[str, float]:
    """LoRA-MFU of a packed cycle of `seconds`: the whole, without attention FLOPs, and the
    layer stack alone (the head's FLOPs and measured time set apart), against the measured
    matmul rate and (`_datasheet`) the datasheet's dense bf16 peak."""
    mfu: dict[str, float] = {}
    layers_s = max(seconds - out["head_s"], 1e-9)
    per_s = {
        "lora_mfu": tokens * out["flops_per_token"] / seconds,
        "lora_mfu_no_attention": tokens * out["flops_per_token_no_attention"] / seconds,
        "layer_stack_mfu": tokens
        * (out["flops_per_token"] - out["flops_per_token_head"])
        / layers_s,
    }
    for peak, suffix in ((run.rate(), ""), (run.datasheet(), "_datasheet")):
        if peak:
            mfu.update({f"{k}{suffix}": v / peak for k, v in per_s.items()})
    mfu["head_flops_share"] = out["flops_per_token_head"] / out["flops_per_token"]
    return mfu


def fits_section(run: Run) -> dict[str, Any]:
    """The dense family's packed cycle with the whole process under FITS_GIB of GPU memory: the
    trainer's pass budget is what is left of it after the weights and every tenant's adapter,
    gradients and Adam moments; `--activation-checkpointing auto` recomputes what it must."""
    unconstrained = run.results["sections"].get("dense", {})
    if run.device != "cuda":
        limit = 1 << 62  # a CPU smoke run: the code path only
    else:
        limit = int(FITS_GIB * (1 << 30))
    shape = run.shape("dense")
    weights = sum(p.stat().st_size for p in run.model("dense").glob("*.safetensors"))
    adapters = run.tenants * _lora_params(run) * 4 * ADAPTER_COPIES
    resident = weights + adapters + (2 << 30)  # + the allocator's slack
    budget = max(limit - resident, 1 << 20) if run.device == "cuda" else 0
    reset_peak(run.device)
    engine = _engine(run, "dense", budget)
    try:
        names, per = _tenants(run, engine, shape)
        tokens = run.tenants * run.datums * run.length
        cycle(engine, per, run.device, lr=1e-3)
        times = []
        for rep in range(run.reps + run.warm):
            seconds = cycle(engine, per, run.device)
            if rep >= run.warm:
                times.append(seconds)
            if run.out_of_time() and times:
                break
        cost, memory = engine._pass_cost, engine.memory_budget()
        plan = cost.checkpoint_plan(run.micro_batch_tokens, run.length, memory.budget_bytes)
        out: dict[str, Any] = {
            "limit_gib": FITS_GIB if run.device == "cuda" else None,
            "pass_budget_bytes": memory.budget_bytes,
            "layers": len(cost.layers),
            "recomputed_layers_per_full_micro_batch": len(plan),
            "peak_gpu_memory_gb": peak_gb(run.device),
            "packed_s": times,
            "packed_tokens_per_s": tokens / statistics.median(times),
        }
        base = unconstrained.get("packed_tokens_per_s")
        if base:
            out["over_unconstrained"] = out["packed_tokens_per_s"] / base
        console.log(
            f"fits: {len(plan)}/{len(cost.layers)} layers recomputed, peak "
            f"{out['peak_gpu_memory_gb']} GB, {out['packed_tokens_per_s']:.0f} tok/s"
        )
        return out
    finally:
        engine.close()
        del engine
        release(run.device)


def _lora_params(run: Run) -> int:
    """One tenant's LoRA parameters on every target of the dense model (rank RANK), read from
    a meta-device instance of it (every target is a linear layer)."""
    from torch import nn

    from lockstep.modeling.architecture import describe_dir

    targets = describe_dir(run.model("dense")).targets
    linears = [t.module for t in targets if isinstance(t.module, nn.Linear)]
    return sum(RANK * (m.in_features + m.out_features) for m in linears)


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
    out: dict[str, Any] = {f"{k}_s": v for k, v in times.items()}
    out.update({f"{k}_tokens_per_s": tokens / v for k, v in med.items()})
    out["packed_over_one_tenant_same_tokens"] = med["one_tenant_same_tokens"] / med["packed"]
    out["packed_over_one_tenant_per_cycle"] = med["one_tenant_per_cycle"] / med["packed"]
    same, serial = (out[f"packed_over_one_tenant_{k}"] for k in ("same_tokens", "per_cycle"))
    out["tenants"], out["row_tokens"] = run.tenants, run.small_length
    size = f"{run.tenants} x {run.small_length}"
    console.log(f"{family}: {size}: packed/one-tenant {same:.2f}, /per-cycle {serial:.2f}")
    return out
