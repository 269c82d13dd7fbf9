"""Vision-language training in the local engine (in-process, tiny Qwen3-VL on the packed path).

  image vs text   forward_backward tokens/s of rows of T tokens holding images (each 256x256
                  image: 256 patches through the tower, 64 tokens) vs rows of T text tokens
  packing         K tenants with images in ONE run_passes vs ONE tenant with all their datums
                  (the same tokens and images; target >= 0.85)
  tower share     the vision tower's time (every image of the pass in one call) over the pass

Every number is the median of --reps runs with its min and max; modes are interleaved rep by
rep. With CUDA (`--gpu`, default when a device exists): a Qwen3.6-35B-A3B-shaped stack (the
Qwen3.5-MoE text model, --layers layers: hidden 2048, 256 experts of 512 + a shared expert,
top-8, Gated DeltaNet 3:1) with a full-width vision tower (27 blocks of 1152), bf16, LoRA rank
32, 8 tenants with images: tokens/s, packed vs one tenant, the tower's share. Without CUDA that
part is skipped and the JSON says so.

    python benchmarks/vision.py [--tenants 4] [--batch 2] [--tokens 256] [--reps 3]
"""

from __future__ import annotations

import argparse
import io
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from common import check, environment, figure_path, print_table, write_json
from PIL import Image

from lockstep.engine.images import ImageInput, ImageLimits, ImageReader
from lockstep.engine.types import AdamConfig, Datum, LoraSpec, OptimRequest, PassRequest
from lockstep.modeling.vision import zoo as vision_zoo
from lockstep.workers.local.trainer import LocalTrainingEngine

NAME = "vision"
PACKING_TARGET = 0.85  # K tenants packed / one tenant with all their datums (report)
IMAGES_PER_ROW = 2


def image(seed: int, side: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 255, (side, side, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def rows(
    engine: LocalTrainingEngine, n: int, tokens: int, side: int, seed: int, with_images: bool
) -> list[Datum]:
    """n rows of `tokens` positions: text, or text around IMAGES_PER_ROW images."""
    spec = engine.card().vision
    assert spec is not None
    reader = ImageReader(spec, ImageLimits(1 << 26, 1 << 26))
    rng = np.random.default_rng(seed)
    out = []
    for r in range(n):
        found: list[ImageInput] = []
        ids: list[int] = []
        if with_images:
            for k in range(IMAGES_PER_ROW):
                ids += rng.integers(0, 1000, 8).tolist()
                picture = reader.image(
                    "b", image(seed * 100 + r * 10 + k, side), "png", None, len(ids)
                )
                found.append(picture)
                ids += [spec.image_token_id] * picture.tokens
        ids += rng.integers(0, 1000, tokens - len(ids)).tolist()
        assert len(ids) == tokens, "--tokens too small for the images"
        targets = np.asarray(ids[1:] + [0])
        out.append(
            Datum(
                np.asarray(ids),
                {"target_tokens": targets, "weights": np.ones(tokens, np.float32)},
                tuple(found),
            )
        )
    return out


def timed(engine: LocalTrainingEngine, requests: list[PassRequest]) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    engine.run_passes(requests)
    engine.optim_step([OptimRequest(r.model_id, AdamConfig(learning_rate=1e-4)) for r in requests])
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def measure(engine: LocalTrainingEngine, args: argparse.Namespace) -> dict[str, Any]:
    k, b, t = args.tenants, args.batch, args.tokens
    for i in range(k):
        engine.create_model(f"t{i}", LoraSpec(rank=(8, 16, 32)[i % 3], seed=i))
    engine.create_model("all", LoraSpec(rank=16, seed=99))
    images = [rows(engine, b, t, args.side, 10 + i, True) for i in range(k)]
    text = [rows(engine, b, t, args.side, 50 + i, False) for i in range(k)]
    every = [d for part in images for d in part]
    vision = engine._vision  # the tower alone, on the pass's images (measurement only)
    assert vision is not None
    every_image = [i for d in every for i in d.images]
    runs: dict[str, list[float]] = {"image": [], "text": [], "packed": [], "one": [], "tower": []}
    timed(engine, [PassRequest("w", "t0", "cross_entropy", {}, False, images[0])])  # warm-up
    for _ in range(args.reps):
        packed = [
            PassRequest(f"p{i}", f"t{i}", "cross_entropy", {}, False, images[i]) for i in range(k)
        ]
        runs["packed"].append(timed(engine, packed))
        runs["one"].append(
            timed(engine, [PassRequest("o", "all", "cross_entropy", {}, False, every)])
        )
        plain = [
            PassRequest(f"x{i}", f"t{i}", "cross_entropy", {}, False, text[i]) for i in range(k)
        ]
        runs["text"].append(timed(engine, plain))
        runs["image"].append(runs["packed"][-1])
        start = time.perf_counter()
        vision.features(every_image)
        runs["tower"].append(time.perf_counter() - start)
    tokens = k * b * t
    image_tps = [tokens / s for s in runs["image"]]
    text_tps = [tokens / s for s in runs["text"]]
    ratio = [o / p for p, o in zip(runs["packed"], runs["one"], strict=True)]
    share = [w / p for w, p in zip(runs["tower"], runs["packed"], strict=True)]
    return {
        "tokens_per_pass": tokens,
        "images_per_pass": len(every_image),
        "patches_per_image": int(np.prod(every_image[0].grid)),
        "image_tokens_per_s": spread(image_tps),
        "text_tokens_per_s": spread(text_tps),
        "image_over_text": spread([i / x for i, x in zip(image_tps, text_tps, strict=True)]),
        "packed_over_one_tenant": spread(ratio),
        "tower_share_of_pass": spread(share),
        "raw_seconds": runs,
    }


def gpu_model(directory: Path, layers: int) -> Path:
    """A Qwen3.6-35B-A3B-shaped random VLM (a few layers), saved in bf16."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from lockstep.modeling import tiny

    eos, vocab = tiny.write_tokenizer(
        directory,
        extra_specials=vision_zoo.VISION_TOKENS,
        chat_template=vision_zoo.VISION_CHAT_TEMPLATE,
    )
    text = {
        "hidden_size": 2048,
        "num_hidden_layers": layers,
        "layer_types": [
            ("linear_attention", "linear_attention", "linear_attention", "full_attention")[i % 4]
            for i in range(layers)
        ],
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "vocab_size": vocab,
        "eos_token_id": eos,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 1e7,
            "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10],
            "mrope_interleaved": True,
        },
    }
    towers = {
        "depth": 27,
        "hidden_size": 1152,
        "num_heads": 16,
        "intermediate_size": 4304,
        "out_hidden_size": 2048,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "num_position_embeddings": 2304,
    }
    config = AutoConfig.for_model(
        "qwen3_5_moe",
        text_config=text,
        vision_config=towers,
        image_token_id=vocab - 2,
        video_token_id=vocab - 1,
        vision_start_token_id=vocab - 4,
        vision_end_token_id=vocab - 3,
        dtype="bfloat16",
    )
    with torch.device("cuda"):
        model = AutoModelForImageTextToText.from_config(config).to(torch.bfloat16)
    model.save_pretrained(str(directory))
    import json

    pre = dict(vision_zoo.PREPROCESSOR, size={"shortest_edge": 65536, "longest_edge": 16777216})
    (directory / "preprocessor_config.json").write_text(json.dumps(pre))
    del model
    torch.cuda.empty_cache()
    return directory


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tenants", type=int, default=4)
    p.add_argument("--batch", type=int, default=2, help="datums per tenant")
    p.add_argument("--tokens", type=int, default=256, help="tokens per datum")
    p.add_argument("--side", type=int, default=256, help="image side in pixels")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (1: steadier on a shared box)"
    )
    p.add_argument("--layers", type=int, default=4, help="GPU stack: decoder layers")
    p.add_argument(
        "--gpu", action=argparse.BooleanOptionalAction, default=torch.cuda.is_available()
    )
    p.add_argument("--name", default=NAME)
    args = p.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    directory = vision_zoo.ensure_family(
        "qwen3_vl", Path(tempfile.gettempdir()) / "lockstep-bench-zoo"
    )
    cpu = measure(LocalTrainingEngine(directory, "bench", device="cpu"), args)
    result: dict[str, Any] = {
        "config": vars(args),
        "environment": environment(),
        "cpu_tiny_qwen3_vl": cpu,
    }
    if args.gpu and torch.cuda.is_available():
        gpu_args = argparse.Namespace(**{**vars(args), "tenants": 8, "tokens": 2048, "side": 448})
        with tempfile.TemporaryDirectory() as tmp:
            engine = LocalTrainingEngine(
                gpu_model(Path(tmp), args.layers), "bench-gpu", device="cuda", dtype="bfloat16"
            )
            result["gpu_qwen3_6_35b_a3b_shape"] = measure(engine, gpu_args)
            result["gpu_qwen3_6_35b_a3b_shape"]["device"] = torch.cuda.get_device_name()
    else:
        result["gpu_qwen3_6_35b_a3b_shape"] = (
            "skipped: no CUDA device on this machine (runs with --gpu where one exists)"
        )
        print("GPU part skipped: no CUDA device (a Qwen3.6-35B-A3B-shaped stack needs one)")
    rows_out = []
    for part in ("cpu_tiny_qwen3_vl", "gpu_qwen3_6_35b_a3b_shape"):
        got = result[part]
        if not isinstance(got, dict):
            continue
        for key in (
            "image_tokens_per_s",
            "text_tokens_per_s",
            "image_over_text",
            "packed_over_one_tenant",
            "tower_share_of_pass",
        ):
            s = got[key]
            rows_out.append((f"{part}: {key}", s["median"], s["min"], s["max"]))
    print_table(
        "vision (median, min, max over reps)", ["measure", "median", "min", "max"], rows_out
    )
    ratio = cpu["packed_over_one_tenant"]["median"]
    met = check(ratio >= PACKING_TARGET)
    print(f"packed / one tenant {ratio:.2f} (target >= {PACKING_TARGET}: {met})")
    path = write_json(args.name, result)
    plot(result, figure_path(args.name))
    print(f"wrote {path}")


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cpu = result["cpu_tiny_qwen3_vl"]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    for ax, keys, title in (
        (axes[0], ("text_tokens_per_s", "image_tokens_per_s"), "tokens/s (same length)"),
        (axes[1], ("packed_over_one_tenant",), f"packed / one tenant (target {PACKING_TARGET})"),
        (axes[2], ("tower_share_of_pass",), "vision tower share of the pass"),
    ):
        med = [cpu[k]["median"] for k in keys]
        err = [
            [cpu[k]["median"] - cpu[k]["min"] for k in keys],
            [cpu[k]["max"] - cpu[k]["median"] for k in keys],
        ]
        ax.bar([k.split("_")[0] for k in keys], med, yerr=err, capsize=4)
        ax.set_title(title, fontsize=9)
    fig.suptitle("tiny Qwen3-VL, local trainer (CPU): median and min-max over reps", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
