"""Tiny random models of the architectures the hosted catalog trains, built offline.

Each family is a transformers config (small sizes, 2 layers, the built-in tokenizer's vocabulary)
with the features that make the architecture different from a dense Qwen3: mixture-of-experts
(fused 3-D experts, shared experts, gate-less relu^2 experts, group-limited routing), Gated
DeltaNet linear attention, Mamba-2 mixers, sliding windows with learned sinks, multi-head latent
attention. Weights come from the same name-seeded generators as the default model
(`tiny.init_weights`), so a family builds to the same bytes on every machine with the same
library versions.

Each is saved in its published layout, the one tinker-cookbook's `weights` tools and both the
service's and the cookbook's transformers versions read: Qwen3.5 / Qwen3.5-MoE as their
`ForConditionalGeneration` (text under `model.language_model.*`, a 1-block vision tower under
`model.visual.*`; `AutoModelForCausalLM` loads the text model), Nemotron-H with `backbone.*` keys
and its `hybrid_override_pattern`, experts one 2-D tensor per expert where transformers writes
them so. `FAMILIES` holds each family's text-model config; `PUBLISHED` the wrapper it is saved in.

Used by the tests and benchmarks, and by `scripts/build_tiny_models.py`:
    python scripts/build_tiny_models.py DIR [FAMILY ...]
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lockstep.modeling import tiny

_COMMON: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "rms_norm_eps": 1e-6,
}

# moe_intermediate_size 48: 2 * 48 != hidden 64, so a fused gate_up_proj's fused axis is never
# ambiguous for tools that infer it from shapes (tinker-cookbook's merge does).
FAMILIES: dict[str, dict[str, Any]] = {
    "qwen3": {"model_type": "qwen3", "intermediate_size": 128},
    "qwen2": {"model_type": "qwen2", "intermediate_size": 128},
    "llama": {"model_type": "llama", "intermediate_size": 128},
    # Not a packed family: trains on the generic path (the model's own sliding-window masks).
    "mistral": {"model_type": "mistral", "intermediate_size": 128, "sliding_window": 16},
    "qwen3_moe": {
        "model_type": "qwen3_moe",
        "intermediate_size": 128,
        "moe_intermediate_size": 48,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
    },
    # Qwen3.5 text models: Gated DeltaNet (linear attention) layers beside full attention.
    "qwen3_5": {
        "model_type": "qwen3_5_text",
        "intermediate_size": 128,
        "layer_types": ["linear_attention", "full_attention"],
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
    },
    "qwen3_5_moe": {
        "model_type": "qwen3_5_moe_text",
        "layer_types": ["linear_attention", "full_attention"],
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "moe_intermediate_size": 48,
        "shared_expert_intermediate_size": 48,
        "num_experts": 8,
        "num_experts_per_tok": 2,
    },
    # Qwen3-Next: Gated DeltaNet (fused qkvz / ba projections) + gated attention, MoE with a
    # gated shared expert in every layer.
    "qwen3_next": {
        "model_type": "qwen3_next",
        "intermediate_size": 128,
        "layer_types": ["linear_attention", "full_attention"],
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "moe_intermediate_size": 48,
        "shared_expert_intermediate_size": 48,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
    },
    # Nemotron-3 (nemotron_h): Mamba-2, MoE (gate-less relu^2 experts + a shared expert),
    # attention (no RoPE), MoE. Chunks of 16 tokens, so test rows span several scan chunks.
    "nemotron_h": {
        "model_type": "nemotron_h",
        "num_hidden_layers": 4,
        "layers_block_type": ["mamba", "moe", "attention", "moe"],
        "intermediate_size": 128,
        "mamba_num_heads": 4,
        "mamba_head_dim": 16,
        "n_groups": 2,
        "ssm_state_size": 16,
        "chunk_size": 16,
        "conv_kernel": 4,
        "moe_intermediate_size": 48,
        "moe_shared_expert_intermediate_size": 32,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_group": 1,
        "topk_group": 1,
    },
    # gpt-oss: sliding-window and full layers, learned sinks, MoE with biases and clamped SwiGLU.
    # A window of 16 tokens, so test rows are longer than the window.
    "gpt_oss": {
        "model_type": "gpt_oss",
        "intermediate_size": 48,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": 16,
        "layer_types": ["sliding_attention", "full_attention"],
        "attention_bias": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 150000.0},
    },
    # DeepSeek-V3 (Kimi-K2 alike): MLA (q/k head 16 + 8, value head 16), a dense first layer,
    # then routed experts with a shared expert and group-limited routing; YaRN RoPE.
    "deepseek_v3": {
        "model_type": "deepseek_v3",
        "num_key_value_heads": 4,  # MLA expands K/V to every head
        "head_dim": 8,  # the RoPE part of a q/k head (qk_rope_head_dim)
        "intermediate_size": 128,
        "moe_intermediate_size": 48,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "n_group": 2,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "q_lora_rank": 32,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 1024,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
    },
}


# Families published as a vision-language model: the wrapper's model_type and its vision tower.
_VISION_TOWER: dict[str, Any] = {
    "depth": 1,
    "hidden_size": 32,
    "num_heads": 2,
    "intermediate_size": 64,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "out_hidden_size": 64,
    "num_position_embeddings": 64,
}
PUBLISHED = {"qwen3_5": "qwen3_5", "qwen3_5_moe": "qwen3_5_moe"}


def served_name(family: str) -> str:
    return f"Lockstep/tiny-{family.replace('_', '-')}"


def ensure_family(family: str, cache_dir: Path) -> Path:
    """Build (once, atomically) and return the tiny model of `family` under `cache_dir`, in the
    family's published layout."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; known: {sorted(FAMILIES)}")
    settings = FAMILIES[family]
    wrapper = PUBLISHED.get(family)
    if wrapper is not None:
        text = {k: v for k, v in settings.items() if k != "model_type"}
        settings = {"model_type": wrapper, "text_config": text, "vision_config": _VISION_TOWER}
    return ensure_model(f"tiny-{family}", settings, cache_dir)


def ensure_model(name: str, settings: dict[str, Any], cache_dir: Path) -> Path:
    """Build (once, atomically) a random model from config `settings` (over the zoo's common
    sizes) under `cache_dir`/`name`-<recipe digest>, and return its directory."""
    return ensure_built(name, lambda directory: build_model(directory, settings), cache_dir)


def ensure_built(name: str, build: Callable[[Path], None], cache_dir: Path) -> Path:
    """Run `build` (once, atomically: into a temporary directory, then renamed) for
    `cache_dir`/`name`-<recipe digest>, and return that directory."""
    final = Path(cache_dir) / f"{name}-{tiny.recipe_digest()}"
    if (final / "config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=final.parent))
    try:
        build(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "config.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def build_model(directory: Path, settings: dict[str, Any]) -> None:
    """Write the built-in tokenizer and a random-init model of config `settings` (with
    `model_type`, over the zoo's common sizes; a vision-language wrapper's over its
    `text_config`) into `directory`."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    eos_id, vocab = tiny.write_tokenizer(directory)
    tokens = {"vocab_size": vocab, "bos_token_id": eos_id, "eos_token_id": eos_id}
    tokens["pad_token_id"] = eos_id
    settings = dict(settings)
    model_type = settings.pop("model_type")
    text = settings.pop("text_config", None)
    if text is not None:
        settings["text_config"] = {**_COMMON, **text, **tokens}
        settings["tie_word_embeddings"] = False
    else:
        settings = {**_COMMON, **tokens, **settings}
    config = AutoConfig.for_model(model_type, dtype="float32", **settings)
    with torch.device("cpu"):
        if text is not None:
            model = AutoModelForImageTextToText.from_config(config)
        else:
            model = AutoModelForCausalLM.from_config(config)
    tiny.init_weights(model, std=0.02)
    with torch.no_grad():  # final norms tiny.init_weights does not recognise by name
        for name, param in model.named_parameters():
            if name.endswith("norm_f.weight"):
                param.fill_(1.0)
    model.generation_config.do_sample = True
    model.save_pretrained(str(directory), safe_serialization=True)
    _published_config(directory)
    if model_type in FUSED_EXPERTS:
        fuse_experts(directory / "model.safetensors")
    tiny.finish_directory(directory)


# Published with each MoE layer's experts fused (`experts.gate_up_proj` [E, 2I, H] = gate | up,
# `experts.down_proj` [E, H, I]), where transformers 5.24 writes one tensor per expert: the
# cookbook's transformers reads only the fused layout for these.
FUSED_EXPERTS = frozenset({"qwen3_5_moe"})
_PER_EXPERT = re.compile(r"^(.+\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


def fuse_experts(path: Path) -> None:
    from safetensors.torch import load_file, save_file

    state = load_file(str(path))
    groups: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        m = _PER_EXPERT.match(key)
        if m is None:
            out[key] = tensor
        else:
            groups.setdefault(m[1], {}).setdefault(m[3], {})[int(m[2])] = tensor
    for experts, parts in groups.items():
        stack = {name: torch.stack([t[e] for e in sorted(t)]) for name, t in parts.items()}
        out[f"{experts}.gate_up_proj"] = torch.cat([stack["gate"], stack["up"]], dim=1)
        out[f"{experts}.down_proj"] = stack["down"]
    save_file({k: v.contiguous() for k, v in out.items()}, str(path), metadata={"format": "pt"})


def _published_config(directory: Path) -> None:
    """Write config.json as the family publishes it, where the transformers version that saved
    it writes fields older ones refuse (Nemotron-H: its `hybrid_override_pattern`, not the
    `layers_block_type` list tinker-cookbook's transformers rejects)."""
    path = directory / "config.json"
    config = json.loads(path.read_text())
    if config.get("model_type") == "nemotron_h":
        letters = {"linear_attention": "M", "mamba": "M", "moe": "E", "full_attention": "*"}
        letters["attention"] = "*"
        config["hybrid_override_pattern"] = "".join(
            letters[t] for t in config.pop("layers_block_type")
        )
        for key in ("mtp_layers_block_type", "time_step_limit"):
            config.pop(key, None)
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
