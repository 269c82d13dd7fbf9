"""The base-model family table of docs/compatibility.md: what each family trains and samples with.

Each row loads the family's tiny model (lockstep/modeling/zoo.py) and asks Lockstep's own rules
what it does with it: the trainer path and LoRA targets (`architecture.describe`), the local
sampler's decoding path, whether the external samplers and the Megatron engine take it. Only the
example model names are written by hand.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

# The hosted / hub models of each family (examples; transformers config `model_type` decides).
EXAMPLES = {
    "qwen3": "Qwen3-0.6B … 32B (the built-in tiny model)",
    "qwen2": "Qwen2.5",
    "llama": "Llama-3.1 / 3.2 / 3.3",
    "mistral": "Mistral-7B (sliding window)",
    "qwen3_moe": "Qwen3-30B-A3B, Qwen3-235B-A22B",
    "qwen3_5": "Qwen3.5 / 3.6 dense (published as VL models: the text model)",
    "qwen3_5_moe": "Qwen3.5-397B-A17B, Qwen3.6-35B-A3B (the text model)",
    "qwen3_next": "Qwen3-Next-80B-A3B",
    "gpt_oss": "gpt-oss-20b, gpt-oss-120b",
    "deepseek_v3": "DeepSeek-V3.1, Kimi-K2 (same architecture)",
    "nemotron_h": "Nemotron-3 Nano / Super / Ultra",
}
ORDER = (
    "qwen3",
    "qwen2",
    "llama",
    "mistral",
    "qwen3_moe",
    "qwen3_5",
    "qwen3_5_moe",
    "qwen3_next",
    "gpt_oss",
    "deepseek_v3",
    "nemotron_h",
)


def _row(family: str, cache: Path) -> str:
    from transformers import AutoModelForCausalLM

    from lockstep.modeling import zoo
    from lockstep.modeling.architecture import describe
    from lockstep.modeling.lora_targets import Role
    from lockstep.workers.megatron.model import HFArch
    from lockstep.workers.megatron.support import UnsupportedByMegatron

    directory = zoo.ensure_family(family, cache)
    model = AutoModelForCausalLM.from_pretrained(directory)
    arch = describe(model)
    layers = ", ".join(sorted(set(arch.layer_types)))
    windows = sorted({a.window for a in arch.shape.attention() if a.window})
    if windows:
        layers += f" (window {', '.join(map(str, windows))})"
    experts = f"; {len(arch.experts)} of {len(arch.layer_types)} layers MoE" if arch.experts else ""
    roles = {t.role for t in arch.targets}
    targets = ", ".join(r.value for r in Role if r in roles)
    gated = all(la.ffn.gated for la in arch.shape.layers if la.ffn is not None and la.ffn.routed)
    if arch.experts:
        targets += " (every expert: w1/w3/w2)" if gated else " (every expert: w1 = up, w2 = down)"
    renamed = sorted({p.name.rsplit(".", 1)[-1] for t in arch.targets for p in t.parts})
    if renamed:
        targets += f"; Tinker's split names {', '.join(renamed)}"
    if any(".attn." in t.name for t in arch.targets):
        targets += "; attention named `attn`"
    external = "yes" if arch.external_lora else "refused"
    try:
        megatron_arch = HFArch.from_dir(directory)
        megatron = "yes" + (" (sliding windows)" if megatron_arch.window else "")
    except UnsupportedByMegatron as exc:  # every feature it names
        megatron = "refused: " + ", ".join(f.value for f in exc.features)
    sampler = "padded batches" if arch.padded_sampling else "grouped (model's own caches)"
    return (
        f"| `{arch.model_type}` | {EXAMPLES[family]} | {layers}{experts} | "
        f"{arch.trainer_path.value} | {targets} | {sampler} | {external} | {megatron} |"
    )


def family_table() -> list[str]:
    with tempfile.TemporaryDirectory(prefix="lockstep-families-") as cache:
        rows = [_row(family, Path(cache)) for family in ORDER]
    return [
        "## Base model families",
        "",
        "Each family is tested on a tiny random model built offline from its transformers config",
        "and saved in its published layout (`python scripts/build_tiny_models.py DIR`;",
        "tests/unit/test_architectures.py, tests/unit/test_pass_cost.py,",
        "tests/integration/test_model_families.py, tests/cookbook/test_weights_export.py).",
        "**packed**: a micro-batch's rows run as one sequence with per-row attention and",
        "per-row recurrent state, equal to the model's own forward; **generic**: each row",
        "through the model's own forward (exact for any causal LM transformers loads, slower;",
        "announced by a warning at start-up, `trainer_path` in `get_info` / capabilities and the",
        "`lockstep_trainer_path` metric). Adapters use Tinker's names and format (3-D",
        "`experts.w1`/`w3`/`w2` tensors for every routed expert; split names where Tinker trains",
        "parts of a fused projection), which tinker-cookbook's `weights` tools merge into the",
        "published checkpoint with the trainer's logprobs; routers stay frozen. A model with a",
        "feature no path computes exactly (logit soft-capping, an unknown expert layout, an",
        "attention option row attention lacks) is refused at load, by name. The Megatron",
        "column names every feature of a family megatron-core's layers would compute otherwise",
        '(read from its shape; docs/megatron.md, "What is refused").',
        "",
        "| model_type | e.g. | layers | trainer | LoRA targets | local sampler | vLLM / SGLang "
        "| Megatron |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
        "",
    ]
