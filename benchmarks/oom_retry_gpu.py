"""A fused pass that runs out of CUDA memory is retried in smaller micro-batches (needs CUDA).

The Qwen3-30B-A3B-shaped stack of `gpu_models.py` (bf16, LoRA rank 32 everywhere), 8 tenants x
2048 tokens in ONE micro-batch. The pass is run once with the whole device, then again with the
process's CUDA memory capped (`torch.cuda.set_per_process_memory_fraction`) below what that
micro-batch needs: the engine must catch the out-of-memory error, undo the partial gradients and
finish in halved micro-batches. Reports both peaks, the retries logged, and how far the retried
pass's logprobs and adapter gradients are from the first, in bf16 and in fp32. They are not
bit-equal on CUDA: cuBLAS picks kernels by shape, so other micro-batch shapes round differently,
and a top-8-of-128 router amplifies that where two experts' scores nearly tie (a flipped expert).
The fp32 run bounds what that costs.

    python benchmarks/oom_retry_gpu.py [--layers 4] [--dtypes bfloat16 float32]
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
from gpu_models import RANK, SHAPES, build_model, data

from lockstep.engine.types import AdamConfig, LoraSpec, OptimRequest, PassRequest
from lockstep.workers.local.trainer import LocalTrainingEngine

NAME = "oom_retry_gpu"
TENANTS, DATUMS, LENGTH = 8, 4, 512


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


def retried(engine: LocalTrainingEngine, names: list[str], per: dict[str, Any]) -> dict[str, Any]:
    """One pass with the whole device, then one capped at half its peak; how they differ."""
    retries = Retries()
    logging.getLogger("lockstep.trainer").addHandler(retries)
    run(engine, names, per)  # warm-up: kernels, allocator
    whole = run(engine, names, per)
    total = torch.cuda.get_device_properties(0).total_memory
    cap = torch.cuda.memory_allocated() + whole["peak_bytes"] // 2
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(cap / total)
    try:
        capped = run(engine, names, per)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        logging.getLogger("lockstep.trainer").removeHandler(retries)
    pairs = list(zip(capped["grads"], whole["grads"], strict=True))
    flat = [torch.cat([g.flatten() for g in side]) for side in zip(*pairs, strict=True)]
    return {
        "cap_bytes": cap,
        "whole": {k: whole[k] for k in ("seconds", "peak_bytes")},
        "capped": {k: capped[k] for k in ("seconds", "peak_bytes")},
        "retries_logged": retries.messages,
        "logprob_max_abs_diff": float(np.max(np.abs(capped["logprobs"] - whole["logprobs"]))),
        # All adapter gradients as one vector, and the worst single tensor (a rarely routed
        # expert's B sums few tokens, so its relative rounding is the largest).
        "grad_relative_diff": float((flat[0] - flat[1]).norm() / flat[1].norm()),
        "grad_worst_tensor_relative_diff": max(
            float((a - b).norm() / max(float(b.norm()), 1e-30)) for a, b in pairs
        ),
    }


def largest_micro_batch(model_dir: Path, tokens: int, dtype: str) -> LocalTrainingEngine:
    """The engine with the largest micro-batch (<= tokens) its memory admission accepts."""
    while True:
        try:
            return LocalTrainingEngine(
                model_dir, "qwen3-30b-a3b-shape", "cuda", micro_batch_tokens=tokens, dtype=dtype
            )
        except ValueError as exc:
            print(f"{dtype}: {exc}; halving the micro-batch", flush=True)
            tokens //= 2
            torch.cuda.empty_cache()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    shape = SHAPES["moe"].with_layers(args.layers)
    names = [f"t{i}" for i in range(TENANTS)]
    per = {t: data(i, shape.vocab, DATUMS, LENGTH) for i, t in enumerate(names)}
    tokens = sum(len(d.tokens) for t in names for d in per[t])
    by_dtype: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "qwen3-30b-a3b-shape"
        build_model(model_dir, shape, "cuda")
        for dtype in args.dtypes:
            engine = largest_micro_batch(model_dir, tokens, dtype)
            for i, t in enumerate(names):
                engine.create_model(t, LoraSpec(rank=RANK, alpha=32.0, seed=i))
            by_dtype[dtype] = {"micro_batch_tokens": engine._budget, **retried(engine, names, per)}
            engine.close()
            del engine
            torch.cuda.empty_cache()
            print(dtype, by_dtype[dtype], flush=True)
    results = {
        "environment": environment(),
        "device": torch.cuda.get_device_name(),
        "layers": args.layers,
        "tokens": tokens,
        "dtypes": by_dtype,
    }
    print_table(
        f"one pass of {tokens} tokens, whole device vs capped at half its peak",
        ["dtype", "whole s", "capped s", "whole GiB", "capped GiB", "retries", "grad rel diff"],
        [
            [
                dtype,
                r["whole"]["seconds"],
                r["capped"]["seconds"],
                r["whole"]["peak_bytes"] / 2**30,
                r["capped"]["peak_bytes"] / 2**30,
                len(r["retries_logged"]),
                r["grad_relative_diff"],
            ]
            for dtype, r in by_dtype.items()
        ],
    )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    x = np.arange(len(by_dtype))
    whole = [r["whole"]["peak_bytes"] / 2**30 for r in by_dtype.values()]
    capped = [r["capped"]["peak_bytes"] / 2**30 for r in by_dtype.values()]
    ax.bar(x - 0.2, whole, 0.4, label="whole device", color="tab:gray")
    ax.bar(x + 0.2, capped, 0.4, label="capped at half: retried", color="tab:blue")
    ax.set_xticks(x, list(by_dtype))
    ax.set_ylabel("pass peak GiB")
    ax.set_title(f"CUDA OOM retry, {tokens}-token pass")
    ax.legend()
    fig.tight_layout()
    fig.savefig(figure_path(NAME), dpi=110)
    write_json(NAME, results)


if __name__ == "__main__":
    main()
