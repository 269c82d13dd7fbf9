"""A fused pass that runs out of CUDA memory is retried in smaller micro-batches (needs CUDA).

The Qwen3-30B-A3B-shaped stack of `moe_gpu.py` (bf16, LoRA rank 32 everywhere), 8 tenants x
2048 tokens in ONE micro-batch. The pass is run once with the whole device, then again with the
process's CUDA memory capped (`torch.cuda.set_per_process_memory_fraction`) below what that
micro-batch needs: the engine must catch the out-of-memory error, undo the partial gradients and
finish in halved micro-batches. Reports both peaks, the retries logged, and how far the retried
pass's logprobs and adapter gradients are from the first (bf16 rounding only).

    python benchmarks/oom_retry_gpu.py [--layers 4]
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from common import environment, figure_path, print_table, write_json
from moe_gpu import QWEN3_30B_A3B, RANK, TENANTS, build_model, data

from lockstep.engine.types import AdamConfig, LoraSpec, OptimRequest, PassRequest
from lockstep.workers.local.engine import LocalTrainingEngine

NAME = "oom_retry_gpu"


class Retries(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "out of memory" in record.getMessage():
            self.messages.append(record.getMessage())


def run(engine: LocalTrainingEngine, names: list[str], per: dict[str, Any]) -> dict[str, Any]:
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    outs = engine.run_passes([PassRequest(t, t, "cross_entropy", {}, False, per[t]) for t in names])
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    grads = [
        p.grad.detach().float().cpu().clone()
        for t in names
        for p in engine._lora.adapter_parameters(t)
        if p.grad is not None
    ]
    engine.optim_step([OptimRequest(t, AdamConfig(learning_rate=0.0)) for t in names])
    return {
        "seconds": seconds,
        "peak_bytes": torch.cuda.max_memory_allocated() - before,
        "logprobs": np.concatenate([np.asarray(o["logprobs"]) for r in outs for o in r.outputs]),
        "grads": grads,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    shape = QWEN3_30B_A3B
    names = [f"t{i}" for i in range(TENANTS)]
    per = {t: data(i, shape) for i, t in enumerate(names)}
    tokens = sum(len(d.tokens) for t in names for d in per[t])
    retries = Retries()
    logging.getLogger("lockstep.trainer").addHandler(retries)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "qwen3-30b-a3b-shape"
        build_model(model_dir, shape, args.layers, "cuda")
        engine = LocalTrainingEngine(
            model_dir, "qwen3-30b-a3b-shape", "cuda", micro_batch_tokens=tokens, dtype="bfloat16"
        )
        for i, t in enumerate(names):
            engine.create_model(t, LoraSpec(rank=RANK, alpha=32.0, seed=i))
        run(engine, names, per)  # warm-up: kernels, allocator
        whole = run(engine, names, per)
        total = torch.cuda.get_device_properties(0).total_memory
        cap = torch.cuda.memory_allocated() + whole["peak_bytes"] // 2
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(cap / total)
        capped = run(engine, names, per)
        torch.cuda.set_per_process_memory_fraction(1.0)
        engine.close()
    grad_rel = max(
        float((a - b).norm() / max(float(b.norm()), 1e-30))
        for a, b in zip(capped["grads"], whole["grads"], strict=True)
    )
    results = {
        "environment": environment(),
        "device": torch.cuda.get_device_name(),
        "layers": args.layers,
        "tokens": tokens,
        "cap_bytes": cap,
        "whole": {k: whole[k] for k in ("seconds", "peak_bytes")},
        "capped": {k: capped[k] for k in ("seconds", "peak_bytes")},
        "retries_logged": retries.messages,
        "logprob_max_abs_diff": float(np.max(np.abs(capped["logprobs"] - whole["logprobs"]))),
        "grad_max_relative_diff": grad_rel,
    }
    print_table(
        f"one pass of {tokens} tokens, whole device vs capped at {cap / 2**30:.1f} GiB",
        ["run", "seconds", "peak GiB", "retries"],
        [
            ["whole", whole["seconds"], whole["peak_bytes"] / 2**30, 0],
            ["capped", capped["seconds"], capped["peak_bytes"] / 2**30, len(retries.messages)],
        ],
    )
    print(results["retries_logged"], results["logprob_max_abs_diff"], grad_rel)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    peaks = [whole["peak_bytes"] / 2**30, capped["peak_bytes"] / 2**30]
    ax.bar(["whole device", "capped (retried)"], peaks, color=["tab:gray", "tab:blue"])
    ax.axhline(whole["peak_bytes"] / 2 / 2**30, color="tab:red", ls="--", label="room left")
    ax.legend()
    ax.set_ylabel("pass peak GiB")
    ax.set_title(f"CUDA OOM retry: {len(retries.messages)} retries, same logprobs")
    fig.tight_layout()
    fig.savefig(figure_path(NAME), dpi=110)
    write_json(NAME, results)


if __name__ == "__main__":
    main()
