"""Tiny random vision-language models in their published layout, built offline.

Each is a transformers `ForConditionalGeneration` (`model.visual.*` + `model.language_model.*`
+ `lm_head`, as Qwen publishes Qwen3.5 / Qwen3.6 and Qwen3-VL), with the zoo's tiny text model
of the family (`zoo.py`), a 2-block vision tower with patches of 16 merged 2x2, the built-in
tokenizer plus Qwen's vision special tokens, a chat template that renders image parts the way
Qwen's does, and the image processor's `preprocessor_config.json` (Qwen's processor settings,
with a small pixel range: a 64x64 image is 4 tokens). Qwen3.6 shares Qwen3.5's architecture and
model types, so it has no family of its own.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from lockstep.modeling import tiny, zoo

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
# ChatML with Qwen's rendering of image parts (OpenAI `image_url` or plain `image` parts).
VISION_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] in ('image', 'image_url') %}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Qwen2-VL's processor with Qwen3-VL's normalisation; pixels from 32x32 to 256x256.
PREPROCESSOR: dict[str, Any] = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen3VLProcessor",
    "do_convert_rgb": True,
    "do_resize": True,
    "do_rescale": True,
    "do_normalize": True,
    "rescale_factor": 1 / 255,
    "resample": 3,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "patch_size": 16,
    "merge_size": 2,
    "temporal_patch_size": 2,
    "size": {"shortest_edge": 32 * 32, "longest_edge": 256 * 256},
}
_VISION: dict[str, Any] = {
    "depth": 2,
    "hidden_size": 32,
    "num_heads": 2,
    "intermediate_size": 64,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "in_channels": 3,
    "out_hidden_size": 64,  # the text model's hidden size
    "num_position_embeddings": 64,  # an 8x8 grid of learned positions, resampled per image
}
# M-RoPE over the zoo's 16-wide heads: 4 rotary frequencies per axis group (t, h, w) interleaved.
_QWEN3_5_ROPE = {
    "rope_type": "default",
    "rope_theta": 10000.0,
    "partial_rotary_factor": 0.5,
    "mrope_section": [2, 1, 1],
    "mrope_interleaved": True,
}
_QWEN3_VL_ROPE = {
    "rope_type": "default",
    "rope_theta": 500000.0,
    "mrope_section": [4, 2, 2],
    "mrope_interleaved": True,
}


def _text(family: str, **extra: Any) -> dict[str, Any]:
    settings = {k: v for k, v in zoo.FAMILIES[family].items() if k != "model_type"}
    return {**zoo._COMMON, **settings, **extra}


FAMILIES: dict[str, dict[str, Any]] = {
    "qwen3_5_vl": {
        "model_type": "qwen3_5",
        "text_config": _text("qwen3_5", rope_parameters=_QWEN3_5_ROPE),
        "vision_config": _VISION,
    },
    "qwen3_5_moe_vl": {
        "model_type": "qwen3_5_moe",
        "text_config": _text("qwen3_5_moe", rope_parameters=_QWEN3_5_ROPE),
        "vision_config": _VISION,
    },
    "qwen3_vl": {
        "model_type": "qwen3_vl",
        "text_config": _text("qwen3", rope_parameters=_QWEN3_VL_ROPE),
        "vision_config": {**_VISION, "deepstack_visual_indexes": [0]},
    },
    "qwen3_vl_moe": {
        "model_type": "qwen3_vl_moe",
        "text_config": _text(
            "qwen3_moe",
            rope_parameters=_QWEN3_VL_ROPE,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            decoder_sparse_step=1,
        ),
        "vision_config": {**_VISION, "deepstack_visual_indexes": [0]},
    },
}


def served_name(family: str) -> str:
    return f"Lockstep/tiny-{family.replace('_', '-')}"


def ensure_family(family: str, cache_dir: Path) -> Path:
    """Build (once, atomically) and return the tiny VLM of `family` under `cache_dir`."""
    if family not in FAMILIES:
        raise ValueError(f"unknown vision family {family!r}; known: {sorted(FAMILIES)}")
    return zoo.ensure_built(f"tiny-{family}", lambda d: build_vlm(d, FAMILIES[family]), cache_dir)


def build_vlm(directory: Path, recipe: dict[str, Any]) -> None:
    """Write the tokenizer (with the vision tokens), a random-init ForConditionalGeneration of
    `recipe` and its image processor config into `directory`."""
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoTokenizer

    eos_id, vocab = tiny.write_tokenizer(
        directory, extra_specials=VISION_TOKENS, chat_template=VISION_CHAT_TEMPLATE
    )
    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    ids: dict[str, int] = {}
    for token in VISION_TOKENS:
        found = tokenizer.convert_tokens_to_ids(token)
        assert isinstance(found, int)
        ids[token] = found
    text = {
        **recipe["text_config"],
        "vocab_size": vocab,
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "pad_token_id": eos_id,
    }
    config = AutoConfig.for_model(
        recipe["model_type"],
        text_config=text,
        vision_config=recipe["vision_config"],
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        eos_token_id=eos_id,
        tie_word_embeddings=False,
        dtype="float32",
    )
    with torch.device("cpu"):
        model = AutoModelForImageTextToText.from_config(config)
    tiny.init_weights(model, std=0.02)
    model.generation_config.do_sample = True
    model.save_pretrained(str(directory), safe_serialization=True)
    if recipe["model_type"] in zoo.FUSED_EXPERTS:  # as published (zoo.py says why)
        zoo.fuse_experts(directory / "model.safetensors")
    (directory / "preprocessor_config.json").write_text(
        json.dumps(PREPROCESSOR, indent=2, sort_keys=True) + "\n"
    )
    tiny.finish_directory(directory)
