"""Kernel-level sections of `gpu_suite.py`: one trainer kernel at a production shape, the fast
path against the path it replaces, forward + backward, with the largest difference of their
outputs and gradients (bf16 on a GPU, fp32 on a CPU smoke run) and the peak memory each adds.

  head       the LM head + log-softmax over a micro-batch's rows (one row at a time, as the
             engine calls it): FUSED (`training.logprobs`) vs CHUNKED (each chunk checkpointed),
             with and without a LoRA on the head
  attention  a packed micro-batch's attention: VARLEN (one varlen flash-attention call) vs the
             per-row SDPA loop (`modeling.attention`), uniform and mixed row lengths, full and
             sliding-window layers
  experts    one MoE layer's experts with every tenant's LoRA on every expert (Qwen3-30B-A3B
             shape, rank 32): each projection's LoRA as ONE grouped GEMM pair over the K x E
             (adapter, expert) groups (`experts.GROUPED_ADAPTERS`) vs a gather, grouped GEMM pair
             and copy per adapter; 8 tenants x 2048 and x 256 tokens
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from gpu_models import RANK, SHAPES, SMOKE
from transformers import AutoConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from lockstep.modeling import attention, experts
from lockstep.modeling.experts import MultiLoRAExperts
from lockstep.modeling.packing import packed_rows
from lockstep.modeling.routing import Routing, RoutingSlot
from lockstep.training import logprobs
from lockstep.training.logprobs import LinearHead, target_logprobs


def _time(fn: Callable[[], Any], device: str, reps: int) -> tuple[list[float], float | None]:
    """Seconds per call after one warm-up call, and the peak memory (GiB) a call adds."""
    fn()
    times = []
    for _ in range(reps):
        if device == "cuda":
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    peak = (torch.cuda.max_memory_allocated() - base) / 1024**3 if device == "cuda" else None
    return times, peak


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def head(device: str, smoke: bool, reps: int) -> dict[str, Any]:
    """16 rows x 512 positions (hidden 4096, vocab 151936, rank 32), the engine's chunk size."""
    rows, length, hidden, vocab, rank = (
        (4, 40, 64, 1024, 8) if smoke else (16, 512, 4096, 151936, 32)
    )
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    elements = logprobs.CHUNK_LOGIT_ELEMENTS * (4 if device == "cuda" else 1)
    chunk = logprobs.chunk_tokens(vocab, elements)
    gen = torch.Generator(device=device).manual_seed(0)
    weight = (torch.randn(vocab, hidden, device=device, generator=gen) * 0.02).to(dtype)
    states = torch.randn(rows * length, hidden, device=device, generator=gen).to(dtype)
    targets = torch.randint(0, vocab, (rows * length, 1), device=device, generator=gen)
    lora_a = torch.randn(rank, hidden, device=device, generator=gen) * hidden**-0.5
    lora_b = torch.randn(vocab, rank, device=device, generator=gen) * 0.01
    out: dict[str, Any] = {"rows": rows, "row_tokens": length, "vocab": vocab, "chunk": chunk}
    for with_lora in (False, True):
        results: dict[str, Any] = {}
        for fused in (True, False):
            h = states.clone().requires_grad_()
            a, b = lora_a.clone().requires_grad_(), lora_b.clone().requires_grad_()
            linear = LinearHead(weight, None, (a, b, 1.0) if with_lora else None)
            value: dict[str, torch.Tensor] = {}

            def step(
                h: torch.Tensor = h,
                linear: LinearHead = linear,
                value: dict[str, torch.Tensor] = value,
                fused: bool = fused,
            ) -> None:
                h.grad = None
                logprobs.FUSED_HEAD = fused
                try:
                    lp = torch.cat(
                        [
                            target_logprobs(
                                h[i * length : (i + 1) * length],
                                targets[i * length : (i + 1) * length],
                                linear,
                                chunk,
                            )
                            for i in range(rows)
                        ]
                    )
                finally:
                    logprobs.FUSED_HEAD = True
                lp.sum().backward()
                assert h.grad is not None
                value["lp"], value["grad"] = lp.detach(), h.grad.detach().clone()

            times, peak = _time(step, device, reps)
            results["fused" if fused else "chunked"] = {
                "s": times,
                "peak_extra_gb": peak,
                "lp": value["lp"],
                "grad": value["grad"],
            }
        f, c = results["fused"], results["chunked"]
        out["head_lora" if with_lora else "no_head_lora"] = {
            "fused_s": f["s"],
            "chunked_s": c["s"],
            "fused_peak_extra_gb": f["peak_extra_gb"],
            "chunked_peak_extra_gb": c["peak_extra_gb"],
            "chunked_over_fused_time": statistics.median(c["s"]) / statistics.median(f["s"]),
            "max_abs_diff_logprobs": _diff(f["lp"], c["lp"]),
            "max_abs_diff_hidden_grad": _diff(f["grad"], c["grad"]),
        }
    return out


def _layout(lengths: list[int]) -> tuple[list[int], list[int], list[int]]:
    widths = [-(-n // 8) * 8 for n in lengths]
    starts = [sum(widths[:i]) for i in range(len(widths))]
    return starts, lengths, widths


def attention_section(device: str, smoke: bool, reps: int) -> dict[str, Any]:
    """Packed micro-batches of 8192 tokens, 32 query / 8 K/V heads of 128, forward + backward."""
    heads, kv, dim = (4, 2, 16) if smoke else (32, 8, 128)
    total = 256 if smoke else 8192
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    rng = np.random.default_rng(0)
    layouts = {
        "uniform_16x512": [total // 16] * 16,
        "mixed_32_to_1024": _mixed(rng, total, 32 if not smoke else 4, total // 8),
    }
    out: dict[str, Any] = {
        "heads": heads,
        "kv_heads": kv,
        "head_dim": dim,
        "varlen_available": attention._VARLEN_KERNEL is not None,
        "varlen_runs_here": varlen_runs(device, dtype),
    }
    for name, lengths in layouts.items():
        for window in (None, 128):
            out[f"{name}_window{window or 0}"] = _attention_case(
                device, dtype, lengths, (heads, kv, dim), window, reps
            )
    return out


def _mixed(rng: np.random.Generator, total: int, low: int, high: int) -> list[int]:
    lengths: list[int] = []
    while sum(-(-n // 8) * 8 for n in lengths) < total - high:
        lengths.append(int(rng.integers(low, high)))
    return lengths


def varlen_runs(device: str, dtype: torch.dtype) -> bool:
    """Whether switching VARLEN on changes anything for this device and dtype."""
    probe = torch.zeros(1, 4, 8, 16, device=device, dtype=dtype)
    return bool(_with_varlen(lambda: attention.varlen_takes(probe, probe, None, None)))


def _with_varlen(fn: Callable[[], Any]) -> Any:
    attention.VARLEN = True
    try:
        return fn()
    finally:
        attention.VARLEN = False


def _attention_case(
    device: str,
    dtype: torch.dtype,
    lengths: list[int],
    dims: tuple[int, int, int],
    window: int | None,
    reps: int,
) -> dict[str, Any]:
    heads, kv, dim = dims
    starts, lengths, widths = _layout(lengths)
    total = sum(widths)
    gen = torch.Generator(device=device).manual_seed(1)
    q0 = torch.randn(1, heads, total, dim, device=device, generator=gen).to(dtype)
    k0 = torch.randn(1, kv, total, dim, device=device, generator=gen).to(dtype)
    v0 = torch.randn(1, kv, total, dim, device=device, generator=gen).to(dtype)
    real = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lengths, strict=True)])
    real = real.to(device)
    result: dict[str, Any] = {"rows": len(lengths), "tokens": total}
    values = {}
    for variant in ("rows", "varlen"):
        q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))

        def step(
            q: torch.Tensor = q, k: torch.Tensor = k, v: torch.Tensor = v, variant: str = variant
        ) -> None:
            for t in (q, k, v):
                t.grad = None
            with packed_rows(starts, lengths, widths):
                o, _ = attention.row_attention_forward(
                    torch.nn.Identity(), q, k, v, None, scaling=dim**-0.5, sliding_window=window
                )
            picked = o[0].index_select(0, real)
            picked.float().square().mean().backward()
            values[variant] = (picked.detach(), q.grad.detach().clone())  # type: ignore[union-attr]

        if variant == "varlen":
            if not _with_varlen(lambda: attention.varlen_takes(q0, v0, window, None)):
                result["varlen"] = "not available here (CUDA, fp16/bf16, torch's varlen kernel)"
                continue
            try:
                times, peak = _with_varlen(functools.partial(_time, step, device, reps))
            except Exception as exc:  # this torch's kernel refused the case: say so
                result["varlen"] = f"failed: {exc!r}"[:300]
                continue
        else:
            times, peak = _time(step, device, reps)
        result[f"{variant}_s"] = times
        result[f"{variant}_peak_extra_gb"] = peak
    if "varlen_s" in result:
        result["rows_over_varlen_time"] = statistics.median(result["rows_s"]) / statistics.median(
            result["varlen_s"]
        )
        result["max_abs_diff_out"] = _diff(values["varlen"][0], values["rows"][0])
        result["max_abs_diff_q_grad"] = _diff(values["varlen"][1], values["rows"][1])
    return result


def experts_section(device: str, smoke: bool, reps: int) -> dict[str, Any]:
    """One experts layer, forward + backward, 8 tenants of rank 32 (the suite's moe shape)."""
    shape = (SMOKE if smoke else SHAPES)["moe"]
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    config = AutoConfig.for_model(shape.model_type, **shape.settings)
    with torch.device(device):
        base = Qwen3MoeExperts(config).to(dtype)  # type: ignore[no-untyped-call]
    gen = torch.Generator(device=device).manual_seed(2)
    with torch.no_grad():
        for p in base.parameters():
            p.copy_(torch.randn(p.shape, device=device, generator=gen) * 0.02)
            p.requires_grad_(False)
    slot = RoutingSlot()
    layer = MultiLoRAExperts(base, slot)
    tenants, rank = 8, 4 if smoke else RANK
    names = [f"t{i}" for i in range(tenants)]
    for name in names:
        for s in layer.slots.values():
            a = torch.randn(s.experts, rank, s.in_features, device=device, generator=gen)
            b = torch.randn(s.experts, s.out_features, rank, device=device, generator=gen)
            s.lora_A[name] = torch.nn.Parameter(a * s.in_features**-0.5)
            s.lora_B[name] = torch.nn.Parameter(b * 0.01)
            s.scale[name] = 2.0
    out: dict[str, Any] = {
        "experts": layer.num_experts,
        "top_k": config.num_experts_per_tok,
        "hidden": config.hidden_size,
        "expert_intermediate": config.moe_intermediate_size,
        "tenants": tenants,
        "rank": rank,
    }
    for per_tenant in (16, 8) if smoke else (2048, 256):
        out[f"{tenants}x{per_tenant}"] = _experts_case(
            layer, slot, Routing(names, None), (per_tenant, config.num_experts_per_tok), reps
        )
    return out


def _experts_case(
    layer: MultiLoRAExperts,
    slot: RoutingSlot,
    routing: Routing,
    sizes: tuple[int, int],
    reps: int,
) -> dict[str, Any]:
    """Each tenant's row of `sizes[0]` tokens routed to `sizes[1]` random experts per token."""
    per_tenant, top_k = sizes
    device = layer.down_proj.device.type
    tokens = len(routing.adapter_ids) * per_tenant
    hidden = layer.slots[next(iter(layer.slots))].in_features
    gen = torch.Generator(device=device).manual_seed(3)
    x0 = torch.randn(tokens, hidden, device=device, generator=gen).to(layer.down_proj.dtype)
    scores = torch.randn(tokens, layer.num_experts, device=device, generator=gen)
    top = scores.topk(top_k, dim=-1)
    index, weights = top.indices, top.values.softmax(-1).to(x0.dtype)
    params = [t for s in layer.slots.values() for g in (s.lora_A, s.lora_B) for t in g.values()]
    result: dict[str, Any] = {"tokens": tokens, "pairs": int(index.numel())}
    values: dict[bool, tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]] = {}
    for grouped in (True, False):
        x = x0.clone().requires_grad_()

        def step(x: torch.Tensor = x, grouped: bool = grouped) -> None:
            x.grad = None
            for p in params:
                p.grad = None
            experts.GROUPED_ADAPTERS = grouped
            slot.current = routing
            try:
                y = layer(x, index, weights)
            finally:
                experts.GROUPED_ADAPTERS = True
                slot.current = None
            y.float().square().mean().backward()
            assert x.grad is not None
            grads = [p.grad.detach().clone() for p in params if p.grad is not None]
            values[grouped] = (y.detach(), x.grad.detach().clone(), grads)

        times, peak = _time(step, device, reps)
        name = "grouped" if grouped else "per_adapter"
        result[f"{name}_s"] = times
        result[f"{name}_peak_extra_gb"] = peak
    new, old = values[True], values[False]
    result["per_adapter_over_grouped_time"] = statistics.median(
        result["per_adapter_s"]
    ) / statistics.median(result["grouped_s"])
    result["max_abs_diff_out"] = _diff(new[0], old[0])
    result["max_abs_diff_input_grad"] = _diff(new[1], old[1])
    result["max_abs_diff_adapter_grad"] = max(
        _diff(a, b) for a, b in zip(new[2], old[2], strict=True)
    )
    result["max_abs_out"] = float(old[0].float().abs().max())  # the scale of the differences
    return result
