"""The local training engine on one GPU at a production shape (needs CUDA; one command).

A Qwen3-8B-shaped model (36 layers, hidden 4096, 32/8 heads, vocab 151936), random init, bf16
base weights, LoRA rank 32 on every linear layer (adapters and Adam state fp32). A cycle is 8
tenants x 2048 tokens (4 datums of 512): forward_backward + optim_step.

  packed      ONE run_passes with all 8 tenants + ONE optim_step
  sequential  the 8 tenants one after another (one run_passes + optim_step each)

Reports tokens/s, LoRA-MFU ((4 N_base + 6 N_lora + causal attention) FLOPs/token over the
measured bf16 matmul rate of the device), packed/sequential, peak GPU memory, and the time to
snapshot one tenant (save_state with Adam moments).

    python benchmarks/engine_gpu.py [--reps 3] [--micro-batch-tokens 4096] [--ckpt]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from common import environment, figure_path, print_table, write_json

from lockstep.engine.types import AdamConfig, Datum, LoraSpec, OptimRequest, PassRequest
from lockstep.workers.local.trainer import LocalTrainingEngine

NAME = "engine_gpu"
TENANTS, DATUMS, LENGTH, RANK = 8, 4, 512, 32
TARGETS = {"lora_mfu": 0.40, "packed_over_sequential": 1.5}


def build_model(directory: Path) -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
    )
    with torch.device("cuda"):
        model = Qwen3ForCausalLM._from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(str(directory))
    del model
    torch.cuda.empty_cache()


def matmul_rate() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(20):
        a @ b
    torch.cuda.synchronize()
    return 20 * 2 * 8192**3 / (time.perf_counter() - start)


def flops_per_token(engine: LocalTrainingEngine) -> float:
    n_base = n_lora = 0
    for layer in engine._lora._layers.values():
        n_base += layer.in_features * layer.out_features
        n_lora += RANK * (layer.in_features + layer.out_features)
    cfg = engine._model.config
    attn = 3 * 2 * 2 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * LENGTH / 2
    return 4 * n_base + 6 * n_lora + attn


def data(tenant: int, vocab: int) -> list[Datum]:
    rng = np.random.default_rng(tenant)
    out = []
    for _ in range(DATUMS):
        seq = rng.integers(0, vocab, LENGTH + 1, dtype=np.int64)
        out.append(Datum(seq[:-1], {"target_tokens": seq[1:]}))
    return out


def cycle(engine: LocalTrainingEngine, tenants: list[str], per: dict[str, list[Datum]]) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    engine.run_passes([PassRequest(t, t, "cross_entropy", {}, False, per[t]) for t in tenants])
    engine.optim_step([OptimRequest(t, AdamConfig(learning_rate=1e-5)) for t in tenants])
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--micro-batch-tokens", type=int, default=4096)
    p.add_argument("--ckpt", action="store_true", help="activation checkpointing")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    rate = matmul_rate()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "qwen3-8b-shape"
        build_model(model_dir)
        engine = LocalTrainingEngine(
            model_dir,
            "qwen3-8b-shape",
            device="cuda",
            micro_batch_tokens=args.micro_batch_tokens,
            dtype="bfloat16",
            activation_checkpointing=args.ckpt,
        )
        vocab = engine.card().vocab_size
        names = [f"t{i}" for i in range(TENANTS)]
        for i, t in enumerate(names):
            engine.create_model(t, LoraSpec(rank=RANK, alpha=32.0, seed=i))
        per = {t: data(i, vocab) for i, t in enumerate(names)}
        torch.cuda.reset_peak_memory_stats()
        packed, sequential = [], []
        for rep in range(args.reps + 1):  # rep 0 warms up
            tp = cycle(engine, names, per)
            ts = sum(cycle(engine, [t], per) for t in names)
            if rep:
                packed.append(tp)
                sequential.append(ts)
        peak = torch.cuda.max_memory_allocated() / 1024**3
        snap = []
        for t in names[:2]:
            start = time.perf_counter()
            engine.save_state(t, Path(tmp) / f"snap-{t}", include_optimizer=True)
            snap.append(time.perf_counter() - start)
        snapshot_bytes = sum(f.stat().st_size for f in (Path(tmp) / "snap-t0").iterdir())
        fpt = flops_per_token(engine)
    tokens = TENANTS * DATUMS * LENGTH
    tp, ts = statistics.median(packed), statistics.median(sequential)
    results: dict[str, Any] = {
        "environment": environment(),
        "device": torch.cuda.get_device_name(),
        "targets": TARGETS,
        "shape": {"tenants": TENANTS, "datums": DATUMS, "length": LENGTH, "rank": RANK},
        "micro_batch_tokens": args.micro_batch_tokens,
        "activation_checkpointing": args.ckpt,
        "matmul_bf16_flops_per_s": rate,
        "flops_per_token": fpt,
        "packed_s": packed,
        "sequential_s": sequential,
        "packed_tokens_per_s": tokens / tp,
        "sequential_tokens_per_s": tokens / ts,
        "packed_over_sequential": ts / tp,
        "lora_mfu": tokens / tp * fpt / rate,
        "peak_gpu_memory_gb": peak,
        "snapshot_s_per_tenant": statistics.mean(snap),
        "snapshot_bytes_per_tenant": snapshot_bytes,
    }
    print_table(
        "Qwen3-8B shape, 8 tenants x 2048 tokens",
        ["packed tok/s", "seq tok/s", "packed/seq", "LoRA-MFU", "peak GB", "snapshot s"],
        [
            [
                results["packed_tokens_per_s"],
                results["sequential_tokens_per_s"],
                results["packed_over_sequential"],
                results["lora_mfu"],
                peak,
                results["snapshot_s_per_tenant"],
            ]
        ],
    )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar(["packed", "sequential"], [tokens / tp, tokens / ts], color=["tab:blue", "tab:gray"])
    ax.set_ylabel("tokens/s")
    ax.set_title(f"Qwen3-8B shape, 8 x 2048 tokens, MFU {results['lora_mfu']:.0%}")
    fig.tight_layout()
    fig.savefig(figure_path(NAME), dpi=110)
    write_json(NAME, results)


if __name__ == "__main__":
    main()
