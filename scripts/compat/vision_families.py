"""The image-input table of docs/compatibility.md: which vision-language families take images,
on which engine.

Each row builds the family's tiny VLM (lockstep/modeling/vision/zoo.py, the published
ForConditionalGeneration layout) and asks Lockstep's own rules: the image processing the
scheduler counts tokens with (`VisionSpec`), the language model's trainer path
(`architecture.describe`), DeepStack, the external samplers' and Megatron's verdicts. Only the
example names and the families without a row of their own are written by hand.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

EXAMPLES = {
    "qwen3_5_vl": "Qwen3.5 / Qwen3.6 dense (Qwen3.6 shares Qwen3.5's architecture)",
    "qwen3_5_moe_vl": "Qwen3.5-397B-A17B, Qwen3.6-35B-A3B",
    "qwen3_vl": "Qwen3-VL-8B / 32B",
    "qwen3_vl_moe": "Qwen3-VL-30B-A3B, Qwen3-VL-235B-A22B",
}


def _row(family: str, cache: Path) -> str:
    import torch
    from transformers import AutoModelForImageTextToText

    from lockstep.engine.types import ModelCard
    from lockstep.modeling.architecture import describe
    from lockstep.modeling.vision import zoo
    from lockstep.modeling.vision.tower import DEEPSTACK
    from lockstep.workers.megatron.model import HFArch

    directory = zoo.ensure_family(family, cache)
    card = ModelCard.from_dir(directory, family)
    spec = card.vision
    assert spec is not None, family
    model = AutoModelForImageTextToText.from_pretrained(directory, dtype=torch.float32)
    arch = describe(model, spec)
    processing = (
        f"patches of {spec.patch_size}, merged {spec.merge_size}x{spec.merge_size}; "
        "Qwen2-VL smart resize"
    )
    tower = "vision tower + merger" + (
        ", DeepStack features" if spec.model_type in DEEPSTACK else ""
    )
    try:
        HFArch.from_dir(directory)
        megatron = "yes"
    except ValueError:
        megatron = "refused"
    external = "yes" if arch.external_lora else "refused"
    return (
        f"| `{spec.model_type}` | {EXAMPLES[family]} | {processing} | {tower} | "
        f"{arch.trainer_path.value} ({arch.model_type}) | yes | {external} | {megatron} |"
    )


def vision_table() -> list[str]:
    from lockstep.modeling.vision import zoo

    with tempfile.TemporaryDirectory(prefix="lockstep-vision-") as cache:
        rows = [_row(family, Path(cache)) for family in zoo.FAMILIES]
    return [
        "## Image input",
        "",
        "`ImageChunk`s (PNG or JPEG, `expected_tokens` checked against the server's own count) on",
        "forward, forward_backward, custom losses, sample and compute_logprobs, for the",
        "vision-language families below (tiny random models in the published",
        "`ForConditionalGeneration` layout; tests/unit/test_vision_models.py,",
        "tests/integration/test_vision.py). The vision tower and merger stay frozen; LoRA trains",
        "the language model under the text family's adapter names. The images of every tenant",
        "in a micro-batch go through the tower in one call; M-RoPE positions are per row.",
        "A text-only model refuses image chunks by name; so does a vision-language checkpoint",
        "without its `preprocessor_config.json`. `image_asset_pointer` chunks read only",
        "`--image-dir`; the OpenAI (`image_url` data: URIs) and Anthropic (base64 `image`",
        "blocks) routes take images too; nothing is ever fetched from a URL.",
        "",
        "| model_type | e.g. | image processing | frozen | trainer (language model) "
        "| local sampler | vLLM / SGLang | Megatron |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
        "| `kimi_k25` | Kimi K2.5 / K2.6 | refused: its image processor exists in transformers "
        "5.24 only as a torchvision backend, which does not run beside this CPU torch, so "
        "Lockstep's processing cannot be tested equal to it | - | not loaded (no causal-LM "
        "class for its text model) | - | refused | refused |",
        "",
    ]
