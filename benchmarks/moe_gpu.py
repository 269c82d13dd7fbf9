"""Expert LoRA on one GPU at a production MoE shape (needs CUDA; one command).

A Qwen3-30B-A3B-shaped layer stack (hidden 2048, 32/4 heads of 128, 128 experts of width 768,
top-8 routing, vocab 151936), a few layers, random init, bf16 base weights, LoRA rank 32 on
every attention projection, every expert's w1/w3/w2 and the LM head (adapters and Adam state
fp32). A cycle is 8 tenants x 2048 tokens (4 datums of 512): forward_backward + optim_step.

  packed      ONE run_passes with all 8 tenants + ONE optim_step
  sequential  the 8 tenants one after another (one run_passes + optim_step each)

Each is run with the experts' grouped GEMM kernel (`torch._grouped_mm`) and with one matmul per
(expert, adapter) group, and reports tokens/s, LoRA-MFU on ACTIVE parameters ((4 N_base_active
+ 6 N_lora_active + causal attention) FLOPs/token over the measured bf16 matmul rate), peak GPU
memory, and how far the two kernels' logprobs are apart.

    python benchmarks/moe_gpu.py [--layers 4] [--reps 3]
    python benchmarks/moe_gpu.py --tiny --device cpu   # a smoke run of the script itself
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from common import environment, figure_path, print_table, write_json

from lockstep.engine import memory
from lockstep.engine.types import AdamConfig, Datum, LoraSpec, OptimRequest, PassRequest
from lockstep.modeling import experts
from lockstep.workers.local.trainer import LocalTrainingEngine

NAME = "moe_gpu"
TENANTS, DATUMS, RANK = 8, 4, 32


@dataclass(frozen=True)
class Shape:
    vocab: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    top_k: int
    expert_width: int
    length: int


QWEN3_30B_A3B = Shape(151936, 2048, 32, 4, 128, 128, 8, 768, 512)
TINY = Shape(512, 64, 4, 2, 16, 8, 2, 32, 32)


def build_model(directory: Path, shape: Shape, layers: int, device: str) -> None:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=3 * shape.hidden,
        moe_intermediate_size=shape.expert_width,
        num_experts=shape.experts,
        num_experts_per_tok=shape.top_k,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        num_hidden_layers=layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=40960,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3MoeForCausalLM._from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(str(directory))


def matmul_rate(device: str) -> float:
    n = 8192 if device == "cuda" else 512
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    sync(device)
    start = time.perf_counter()
    for _ in range(20):
        a @ b
    sync(device)
    return 20 * 2 * n**3 / (time.perf_counter() - start)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def active_flops_per_token(shape: Shape, layers: int) -> dict[str, float]:
    """Parameters a token passes through (top-k experts, not all) and the FLOPs of one training
    token: 4 per frozen base weight (forward + input gradient), 6 per LoRA weight, plus causal
    attention."""
    h, q, kv, r = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, RANK
    attn_base = h * q + 2 * h * kv + q * h
    attn_lora = r * ((h + q) + 2 * (h + kv) + (q + h))
    expert_base = shape.top_k * 3 * h * shape.expert_width
    expert_lora = shape.top_k * 3 * r * (h + shape.expert_width)
    router = h * shape.experts
    n_base = layers * (attn_base + expert_base + router) + shape.vocab * h
    n_lora = layers * (attn_lora + expert_lora) + r * (h + shape.vocab)
    attention = 3 * 2 * 2 * layers * q * shape.length / 2
    return {
        "active_base_params": n_base,
        "active_lora_params": n_lora,
        "flops_per_token": 4 * n_base + 6 * n_lora + attention,
    }


def data(tenant: int, shape: Shape) -> list[Datum]:
    rng = np.random.default_rng(tenant)
    out = []
    for _ in range(DATUMS):
        seq = rng.integers(0, shape.vocab, shape.length + 1, dtype=np.int64)
        out.append(Datum(seq[:-1], {"target_tokens": seq[1:]}))
    return out


def cycle(
    engine: LocalTrainingEngine, tenants: list[str], per: dict[str, list[Datum]], device: str
) -> float:
    sync(device)
    start = time.perf_counter()
    engine.run_passes([PassRequest(t, t, "cross_entropy", {}, False, per[t]) for t in tenants])
    engine.optim_step([OptimRequest(t, AdamConfig(learning_rate=1e-5)) for t in tenants])
    sync(device)
    return time.perf_counter() - start


def logprobs(engine: LocalTrainingEngine, tenants: list[str], per: dict[str, list[Datum]]) -> Any:
    outs = engine.run_passes(
        [PassRequest(t, t, "cross_entropy", {}, True, per[t]) for t in tenants]
    )
    return np.concatenate([np.asarray(o["logprobs"]) for r in outs for o in r.outputs])


def measure(
    engine: LocalTrainingEngine, names: list[str], per: dict[str, list[Datum]], args: Any
) -> dict[str, Any]:
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    packed, sequential = [], []
    for rep in range(args.reps + 1):  # rep 0 warms up
        tp = cycle(engine, names, per, args.device)
        ts = sum(cycle(engine, [t], per, args.device) for t in names)
        if rep:
            packed.append(tp)
            sequential.append(ts)
        print(f"  rep {rep}: packed {tp:.3f} s, sequential {ts:.3f} s", flush=True)
    peak = torch.cuda.max_memory_allocated() / 1024**3 if args.device == "cuda" else 0.0
    return {"packed_s": packed, "sequential_s": sequential, "peak_gpu_memory_gb": peak}


def pass_memory(
    engine: LocalTrainingEngine, names: list[str], per: dict[str, list[Datum]], model_dir: Path
) -> dict[str, Any]:
    """The admission formula's cost of one packed pass vs the CUDA peak it really takes."""
    budget = engine.memory_budget()
    shape = engine._lora.arch.shape
    cost = memory.PassCost.from_shape(shape, 2, False, engine._budget, engine._chunk, False)
    out: dict[str, Any] = {
        "budget_bytes": budget.budget_bytes,
        "budget_source": budget.source,
        "max_row_tokens": budget.max_row_tokens,
        "formula_pass_bytes": cost.pass_bytes(max(len(d.tokens) for d in per[names[0]])),
    }
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        engine.run_passes([PassRequest(t, t, "cross_entropy", {}, False, per[t]) for t in names])
        torch.cuda.synchronize()
        out["measured_pass_peak_bytes"] = torch.cuda.max_memory_allocated() - before
        engine.optim_step([OptimRequest(t, AdamConfig(learning_rate=0.0)) for t in names])
    return out


def profile(
    engine: LocalTrainingEngine, names: list[str], per: dict[str, list[Datum]], device: str
) -> str:
    """Where one packed cycle's time goes: the top operators by self device (CPU) time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with torch_profile(activities=activities) as prof:
        cycle(engine, names, per, device)
    key = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
    return str(prof.key_averages().table(sort_by=key, row_limit=30, max_name_column_width=60))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--micro-batch-tokens", type=int, default=8192)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="a tiny shape (smoke run)")
    p.add_argument("--profile", action="store_true", help="write the top operators of a cycle")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device (or --tiny --device cpu for a smoke run)")
    shape = TINY if args.tiny else QWEN3_30B_A3B
    rate = matmul_rate(args.device)
    names = [f"t{i}" for i in range(TENANTS)]
    per = {t: data(i, shape) for i, t in enumerate(names)}
    kernels: dict[str, dict[str, Any]] = {}
    lps: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "qwen3-30b-a3b-shape"
        build_model(model_dir, shape, args.layers, args.device)
        engine = LocalTrainingEngine(
            model_dir,
            "qwen3-30b-a3b-shape",
            device=args.device,
            micro_batch_tokens=args.micro_batch_tokens,
            dtype="bfloat16",
        )
        for i, t in enumerate(names):
            engine.create_model(t, LoraSpec(rank=RANK, alpha=32.0, seed=i))
        admission = pass_memory(engine, names, per, model_dir)
        print(f"admission: {admission}", flush=True)
        for i, t in enumerate(names):  # both variants start from fresh adapters
            engine.delete_model(t)
            engine.create_model(t, LoraSpec(rank=RANK, alpha=32.0, seed=i))
        for kernel in (True, False):
            label = "grouped_kernel" if kernel else "per_group_matmul"
            experts.GROUPED_KERNEL = kernel
            print(f"{label}:", flush=True)
            lps[label] = logprobs(engine, names, per)  # before any step of this variant
            kernels[label] = measure(engine, names, per, args)
            for i, t in enumerate(names):  # the next variant starts from the same adapters
                engine.delete_model(t)
                engine.create_model(t, LoraSpec(rank=RANK, alpha=32.0, seed=i))
        experts.GROUPED_KERNEL = True
        if args.profile:
            table = profile(engine, names, per, args.device)
            figure_path(NAME).with_name(f"{NAME}_profile.txt").write_text(table)
            print(table)
        engine.close()
    tokens = TENANTS * DATUMS * shape.length
    flops = active_flops_per_token(shape, args.layers)
    for k in kernels.values():
        tp, ts = statistics.median(k["packed_s"]), statistics.median(k["sequential_s"])
        k["packed_tokens_per_s"] = tokens / tp
        k["sequential_tokens_per_s"] = tokens / ts
        k["packed_over_sequential"] = ts / tp
        k["lora_mfu_active"] = tokens / tp * flops["flops_per_token"] / rate
    results: dict[str, Any] = {
        "environment": environment(),
        "device": torch.cuda.get_device_name() if args.device == "cuda" else args.device,
        "shape": {**shape.__dict__, "layers": args.layers, "tenants": TENANTS, "rank": RANK},
        "datums_per_tenant": DATUMS,
        "micro_batch_tokens": args.micro_batch_tokens,
        "matmul_bf16_flops_per_s": rate,
        **flops,
        "kernels": kernels,
        "admission": admission,
        "logprob_max_abs_diff_between_kernels": float(
            np.max(np.abs(lps["grouped_kernel"] - lps["per_group_matmul"]))
        ),
        "grouped_over_per_group_packed": kernels["grouped_kernel"]["packed_tokens_per_s"]
        / kernels["per_group_matmul"]["packed_tokens_per_s"],
    }
    print_table(
        f"Qwen3-30B-A3B shape x {args.layers} layers, 8 tenants x 2048 tokens, rank {RANK}",
        ["experts kernel", "packed tok/s", "seq tok/s", "packed/seq", "LoRA-MFU", "peak GB"],
        [
            [
                label,
                k["packed_tokens_per_s"],
                k["sequential_tokens_per_s"],
                k["packed_over_sequential"],
                k["lora_mfu_active"],
                k["peak_gpu_memory_gb"],
            ]
            for label, k in kernels.items()
        ],
    )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    labels = list(kernels)
    x = np.arange(len(labels))
    ax.bar(x - 0.2, [kernels[k]["packed_tokens_per_s"] for k in labels], 0.4, label="packed")
    ax.bar(x + 0.2, [kernels[k]["sequential_tokens_per_s"] for k in labels], 0.4, label="seq")
    ax.set_xticks(x, labels)
    ax.set_ylabel("tokens/s")
    mfu = kernels["grouped_kernel"]["lora_mfu_active"]
    ax.set_title(f"Qwen3-30B-A3B shape x {args.layers} layers, 8 x 2048 tokens (MFU {mfu:.0%})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(figure_path(NAME), dpi=110)
    write_json(NAME, results)


if __name__ == "__main__":
    main()
