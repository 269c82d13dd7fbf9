"""What pricing a custom loss costs the scheduler: creation, and a 4096-datum request.

A 510-node graph (PPO-style blocks traced by the SDK's own tracer), priced the way admission
prices it (`lockstep.custom_loss.pricing`: the program on meta tensors under the FLOP and memory
counter, forward and backward, cached per shape bucket):

  create       `check_created` on probe shapes (a new loss id each rep: nothing cached)
  request cold the pricing of a 4096-datum forward_backward's datums with no bucket priced
               yet: one pricing per bucket
  request warm the same loss, another 4096 datums of the same lengths (new values): every
               bucket priced already, as in a training loop once it has seen each length class
  inputs check  the same request's rank and finite-value checks of its inputs (numpy, O(data);
               admission runs them before the pricing)
  per shape   one pricing on a datum's own shapes (what pricing every distinct shape would
               cost per datum), and the forward alone on meta tensors (the dry run this
               replaces ran that once per new datum shape)

    python benchmarks/custom_loss_pricing.py [--reps 5] [--datums 4096]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Literal

import numpy as np
import torch
from common import environment, figure_path, print_table, write_json
from tinker.lib.public_interfaces.custom_loss import encode_graph, trace_loss

from lockstep.custom_loss import graph, pricing, program
from lockstep.custom_loss.bound import CostBound
from lockstep.engine.types import CustomLoss, CustomLossNode, Datum, MemoryBudget

NAME = "custom_loss_pricing"
NODES = 510
RANKS: dict[str, Literal[0, 1, 2]] = {"logprobs": 1, "old": 1, "ref": 1, "adv": 1, "mask": 1}
BOUND = CostBound.of(0, MemoryBudget(8 << 30, 4096, "benchmark"))


def big_loss(logprobs, old, ref, adv, mask):  # type: ignore[no-untyped-def]
    """PPO + KL blocks, then `PAD` multiplications: the traced graph has NODES nodes."""
    total = logprobs.sum() * 0.0
    for i in range(24):
        ratio = torch.exp(logprobs - old)
        pg = -torch.minimum(ratio * adv, torch.clamp(ratio, 0.8, 1.2) * adv)
        kl = torch.exp(ref - logprobs) - (ref - logprobs) - 1
        total = total + ((pg + 0.01 * i * kl) * mask).sum() / mask.sum().clamp(min=1.0)
    for _ in range(PAD):
        total = total * 1.0
    return total, {"custom/total:sum": total}


PAD = 0  # set by `run` so that the graph has NODES nodes


def _loss(loss_id: str) -> CustomLoss:
    handle = trace_loss(big_loss, RANKS, "bench")
    nodes = [
        CustomLossNode(d["op"], d["name"], d["target"], tuple(d["args"]), d["kwargs"])
        for d in (n.model_dump(mode="json") for n in encode_graph(handle).nodes)
    ]
    return graph.build_loss(loss_id, handle.name, list(RANKS.items()), nodes)


def _data(n: int, seed: int, values: int = 0) -> list[Datum]:
    lengths = np.random.default_rng(seed).integers(1, 4097, n)
    rng = np.random.default_rng([seed, values])
    out = []
    for t in lengths:
        x = rng.standard_normal(t).astype(np.float32)
        out.append(
            Datum(
                np.zeros(t, np.int64),
                {"target_tokens": np.zeros(t, np.int64), "old": x, "ref": x, "adv": x, "mask": x},
            )
        )
    return out


def _admit(loss: CustomLoss, data: list[Datum]) -> tuple[float, float]:
    """Seconds for what admission does with a request's datums: the inputs' ranks and values
    (`graph.check_datum`, numpy over every value), then the prices."""
    start = time.perf_counter()
    for i, datum in enumerate(data):
        graph.check_datum(loss, datum, i)
    checked = time.perf_counter()
    pricing.check_data(loss, data, BOUND)
    return checked - start, time.perf_counter() - checked


def run(args: argparse.Namespace) -> dict[str, Any]:
    global PAD
    PAD = NODES - len(_loss("count").nodes)
    loss_nodes = len(_loss("count").nodes)
    assert loss_nodes == NODES, loss_nodes
    first = time.perf_counter()
    pricing.check_created(_loss("warm-up"), BOUND, 4096)  # torch's decompositions load once
    first_use = time.perf_counter() - first
    reps: list[dict[str, float]] = []
    for rep in range(args.reps):
        loss = _loss(f"bench-{rep}")
        start = time.perf_counter()
        pricing.check_created(loss, BOUND, 4096)
        create = time.perf_counter() - start
        buckets_before = len(pricing._PRICES)
        _, cold = _admit(loss, _data(args.datums, rep))
        buckets = len(pricing._PRICES) - buckets_before
        inputs, warm = _admit(loss, _data(args.datums, rep, values=1))
        shapes = graph.datum_shapes(loss, _data(1, 100 + rep)[0])
        start = time.perf_counter()
        pricing.priced(loss, shapes)  # a shape of its own: priced, not looked up
        per_shape = time.perf_counter() - start
        prog = program.program(loss)
        start = time.perf_counter()
        pricing._forward(prog, shapes)
        forward = time.perf_counter() - start
        reps.append(
            {
                "create_s": create,
                "request_cold_s": cold,
                "buckets_priced": buckets,
                "request_warm_s": warm,
                "request_inputs_check_s": inputs,
                "per_shape_priced_s": per_shape,
                "per_shape_forward_s": forward,
            }
        )
    keys = [k for k in reps[0] if k.endswith("_s")]
    summary = {
        k: {
            "median": statistics.median(r[k] for r in reps),
            "min": min(r[k] for r in reps),
            "max": max(r[k] for r in reps),
        }
        for k in keys
    }
    return {
        "config": {"nodes": NODES, "datums": args.datums, "reps": args.reps, "bound": str(BOUND)},
        "environment": environment(),
        "first_use_in_process_s": first_use,
        "summary": summary,
        "reps": reps,
    }


def plot(result: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = ["create", "request cold", "request warm"]
    keys = ["create_s", "request_cold_s", "request_warm_s"]
    s = result["summary"]
    med = [s[k]["median"] * 1000 for k in keys]
    err = [
        [m - s[k]["min"] * 1000 for m, k in zip(med, keys, strict=True)],
        [s[k]["max"] * 1000 - m for m, k in zip(med, keys, strict=True)],
    ]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar(labels, med, yerr=err, capsize=4)
    ax.set_ylabel("ms (median, min-max)")
    n = result["config"]["datums"]
    ax.set_title(f"pricing a {NODES}-node custom loss; requests of {n} datums")
    fig.tight_layout()
    fig.savefig(figure_path(NAME))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--datums", type=int, default=4096)
    args = parser.parse_args()
    result = run(args)
    rows = [
        (k, v["median"] * 1000, v["min"] * 1000, v["max"] * 1000)
        for k, v in result["summary"].items()
    ]
    print_table(f"{NODES}-node loss, ms", ["", "median", "min", "max"], rows)
    first = result["first_use_in_process_s"]
    print(f"first use in a process (torch decompositions load): {first:.2f} s")
    write_json(NAME, result)
    plot(result)


if __name__ == "__main__":
    main()
