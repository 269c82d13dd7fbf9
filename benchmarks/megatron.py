"""Training throughput of the local engine vs the Megatron engine (engine level, no server).

Each layout runs the same cycles: T tenants (different LoRA ranks) packed into one
`run_passes` (forward_backward, cross_entropy) and one batched `optim_step`. Reported per layout:
tokens/s (real tokens of the pass, step included) and LoRA-MFU:

    FLOPs/token = 4 N            frozen base: forward 2N + input-gradient backward 2N
                + 6 N_lora       adapters: forward, input gradient, weight gradient
                + 6 L n_h d_h ctx attention scores and values (fwd + 2x bwd), causal mean ctx
    LoRA-MFU    = tokens/s x FLOPs/token / (peak x ranks)

N counts every matmul weight (layers + LM head, not the embedding lookup); N_lora the adapter
of the token's tenant. `peak` is MEASURED: the best fp32 GEMM rate on the same device (no TF32),
since the CPU has no datasheet number; the device used is printed and stored. On a one-GPU box
only world-size-1 layouts run (NCCL puts one rank per GPU); on CPU the ranks use gloo.

    python benchmarks/megatron.py [--layouts local,tp1,tp2,pp2,dp2,tp2pp2] [--cycles 4] [--rows 8]
                                  [--seq 128] [--model DIR]
"""

from __future__ import annotations

import sys
from pathlib import Path

# This file is named megatron.py and megatron-core is a namespace package, so a module named
# megatron anywhere on the path would shadow it: drop this folder from the path (the spawned
# ranks inherit it). benchmarks/common is imported from its file in `_common()`.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [x for x in sys.path if Path(x or ".").resolve() != _HERE]

import argparse  # noqa: E402
import os  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402
from types import ModuleType  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from lockstep.engine.interface import TrainingEngine  # noqa: E402
from lockstep.engine.types import (  # noqa: E402
    AdamConfig,
    Datum,
    LoraSpec,
    OptimRequest,
    PassRequest,
)
from lockstep.modeling.tiny import ensure_default_model  # noqa: E402
from lockstep.workers.megatron.model import HFArch  # noqa: E402
from lockstep.workers.megatron.parallel import ParallelConfig  # noqa: E402

NAME = "megatron"


def _common() -> ModuleType:
    """benchmarks/common.py, loaded by path (its folder is off sys.path, see above)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_common", _HERE / "common.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_common"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


RANKS = (8, 16, 32)  # one tenant per rank
LAYOUTS = {
    "tp1": ParallelConfig(),
    "tp2": ParallelConfig(tp=2),
    "pp2": ParallelConfig(pp=2),
    "dp2": ParallelConfig(dp=2),
    "tp2pp2": ParallelConfig(tp=2, pp=2),
}


@dataclass
class Result:
    layout: str
    device: str
    world_size: int
    tokens_per_cycle: int
    seconds_per_cycle: float
    tokens_per_s: float
    flops_per_token: float
    lora_mfu: float


def flops_per_token(arch: HFArch, rank: int, ctx: float) -> float:
    q, kv = arch.heads * arch.head_dim, arch.kv_heads * arch.head_dim
    per_layer = arch.hidden * (q + 2 * kv) + q * arch.hidden + 3 * arch.hidden * arch.intermediate
    n = arch.layers * per_layer + arch.hidden * arch.vocab
    lora_layer = rank * (
        (arch.hidden + q)
        + 2 * (arch.hidden + kv)
        + (q + arch.hidden)
        + 2 * (arch.hidden + arch.intermediate)
        + (arch.intermediate + arch.hidden)
    )
    n_lora = arch.layers * lora_layer + rank * (arch.hidden + arch.vocab)
    attention = 6 * arch.layers * arch.heads * arch.head_dim * ctx
    return float(4 * n + 6 * n_lora + attention)


def measured_peak(device: torch.device, size: int = 1024, reps: int = 20) -> float:
    """Best fp32 GEMM FLOP/s on `device` (the MFU denominator)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    a = torch.randn(size, size, device=device)
    b = torch.randn(size, size, device=device)
    best = float("inf")
    for _ in range(reps + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        (a @ b).sum().item()
        best = min(best, time.perf_counter() - t)
    return 2 * size**3 / best


def workload(rows: int, seq: int, vocab: int, seed: int) -> list[PassRequest]:
    rng = np.random.default_rng(seed)
    out = []
    for i, _ in enumerate(RANKS):
        data = [
            Datum(
                rng.integers(0, vocab, seq),
                {"target_tokens": rng.integers(0, vocab, seq), "weights": np.ones(seq, np.float32)},
            )
            for _ in range(rows)
        ]
        out.append(PassRequest(f"r{i}", f"tenant{i}", "cross_entropy", {}, False, data))
    return out


def run_layout(
    engine: TrainingEngine, cycles: int, rows: int, seq: int, vocab: int, label: str
) -> float:
    """Seconds per cycle (median after one warm-up cycle)."""
    for i, r in enumerate(RANKS):
        engine.create_model(f"tenant{i}", LoraSpec(rank=r, alpha=r, seed=i))
    steps = [OptimRequest(f"tenant{i}", AdamConfig(learning_rate=1e-4)) for i in range(len(RANKS))]
    times = []
    for c in tqdm(range(cycles + 1), desc=label, leave=False):
        reqs = workload(rows, seq, vocab, c)
        t = time.perf_counter()
        engine.run_passes(reqs)
        engine.optim_step(steps)
        if c:  # the first cycle warms up allocators and kernels
            times.append(time.perf_counter() - t)
    return float(np.median(times))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--layouts", default="local,tp1,tp2,pp2,dp2,tp2pp2")
    p.add_argument("--cycles", type=int, default=4)
    p.add_argument("--rows", type=int, default=8, help="rows per tenant per cycle")
    p.add_argument("--seq", type=int, default=128, help="tokens per row")
    p.add_argument("--model", type=Path, default=None, help="HF model dir (default: tiny Qwen3)")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="CPU threads per rank (and for the local engine); 1 keeps timings "
        "stable on a shared box, where oversubscribed OpenMP threads stall",
    )
    a = p.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(a.threads)  # the spawned ranks read it
    torch.set_num_threads(a.threads)

    common = _common()
    from lockstep.workers.local.trainer import LocalTrainingEngine
    from lockstep.workers.megatron.trainer import MegatronTrainingEngine

    model_dir = a.model or ensure_default_model(Path(tempfile.gettempdir()) / "lockstep-bench")
    arch = HFArch.from_dir(model_dir)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    threads = torch.get_num_threads()
    device_name = torch.cuda.get_device_name(0) if cuda else f"cpu ({threads} thread/rank)"
    print(f"device: {device_name}")
    peak = measured_peak(device)  # measured again at the end: the best of both (shared boxes)
    tokens = len(RANKS) * a.rows * a.seq
    fpt = float(np.mean([flops_per_token(arch, r, (a.seq + 1) / 2) for r in RANKS]))
    results = []
    for layout in a.layouts.split(","):
        if layout == "local":
            engine: TrainingEngine = LocalTrainingEngine(model_dir, "bench", device=device)
            world = 1
        else:
            parallel = LAYOUTS[layout]
            world = parallel.world_size
            if cuda and world > 1:
                print(f"skip {layout}: {world} ranks need {world} GPUs (NCCL: one rank per GPU)")
                continue
            engine = MegatronTrainingEngine(model_dir, "bench", parallel, launcher="process")
        try:
            sec = run_layout(engine, a.cycles, a.rows, a.seq, arch.vocab, layout)
        finally:
            engine.close()
        results.append(Result(layout, device_name, world, tokens, sec, tokens / sec, fpt, 0.0))
    peak = max(peak, measured_peak(device))
    for r in results:
        r.lora_mfu = r.tokens_per_s * r.flops_per_token / (peak * r.world_size)  # per rank
    common.print_table(
        f"training throughput ({device_name}, measured fp32 GEMM peak {peak / 1e9:.1f} GFLOP/s)",
        ["layout", "ranks", "s/cycle", "tokens/s", "LoRA-MFU"],
        [
            [
                r.layout,
                r.world_size,
                f"{r.seconds_per_cycle:.3f}",
                f"{r.tokens_per_s:.0f}",
                f"{100 * r.lora_mfu:.2f}%",
            ]
            for r in results
        ],
    )
    payload = {
        "environment": common.environment(),
        "device": device_name,
        "peak_flops": peak,
        "model": str(model_dir),
        "arch": asdict(arch),
        "tenant_ranks": list(RANKS),
        "rows_per_tenant": a.rows,
        "seq": a.seq,
        "cycles": a.cycles,
        "results": [asdict(r) for r in results],
    }
    print(f"wrote {common.write_json(NAME, payload)}")
    plot(results, device_name, common.figure_path(NAME))


def plot(results: list[Result], device_name: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    names = [r.layout for r in results]
    ax1.bar(names, [r.tokens_per_s for r in results], color="tab:blue")
    ax1.set_ylabel("tokens / s")
    ax1.set_title("throughput (pass + step)")
    ax2.bar(names, [100 * r.lora_mfu for r in results], color="tab:orange")
    ax2.set_ylabel("LoRA-MFU (% of measured fp32 GEMM peak)")
    ax2.set_title("LoRA-MFU")
    fig.suptitle(f"local vs megatron engine — {device_name}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
