"""Model families: every family Lockstep names, declared once, and what each part computes for it.

A family is a transformers `model_type`. A text model's is its own; a vision-language model has
two: its wrapper's (`qwen3_vl`, what its image processing is read by) and its language model's
(`text_config.model_type`, `qwen3_vl_text`: what the trainer, the samplers and Megatron read).
Every part that treats families differently reads this table, never a list of its own:

- `packed`: the local trainer's PACKED path computes the family (row attention per packed row,
  recurrent mixers per row span), tested against the model's own forward
  (tests/unit/test_architectures.py); every other family takes the GENERIC path
  (`modeling/architecture.py`).
- `external_lora`: vLLM and SGLang serve its multi-LoRA as Lockstep trains it (every target
  the trainer adapts, same numbers): the dense families. vLLM's MoE expert LoRA is experimental
  and its LoRA for linear-attention hybrids, sinks and MLA unverified; SGLang has no expert LoRA
  (`rollout/config.py` refuses the rest; `--sampler local` samples every family).
- `llama_layers`: its decoder layer is Llama's (pre-norm RMSNorm with a plain weight, unscaled
  embeddings), what megatron-core's layer computes; what a shape does not say, since norm
  placement and embedding scaling live in a model's forward (`workers/megatron/support.py`).
- `images`: a vision-language wrapper whose images Lockstep processes (Qwen's smart resize,
  patches merged 2x2: `engine/images.py`).

`ModelConfig` is the one reader of a model directory's `config.json` (the card, the image
processing, the pass cost and the Megatron converter take it from there). Pure data: no torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Family:
    model_type: str
    packed: str = ""  # what the PACKED path computes for it ("": the GENERIC path)
    external_lora: bool = False
    llama_layers: bool = False
    images: bool = False


FAMILIES: tuple[Family, ...] = (
    Family("llama", "causal attention", external_lora=True, llama_layers=True),
    Family("mistral", llama_layers=True),
    Family(
        "qwen2",
        "causal attention (sliding windows when configured)",
        external_lora=True,
        llama_layers=True,
    ),
    Family("qwen3", "causal attention", external_lora=True, llama_layers=True),
    Family("qwen3_moe", "causal attention, fused experts", llama_layers=True),
    Family("qwen3_5_text", "Gated DeltaNet + gated causal attention"),
    Family("qwen3_5_moe_text", "Gated DeltaNet + gated causal attention, fused and shared experts"),
    Family("qwen3_next", "Gated DeltaNet + gated causal attention, fused and shared experts"),
    Family("gpt_oss", "sliding-window and full attention with sinks, fused experts with biases"),
    Family("deepseek_v3", "multi-head latent attention, dense and fused + shared experts"),
    Family("nemotron_h", "Mamba-2 + causal attention, gate-less relu^2 experts + shared experts"),
    # Qwen3-VL's language models: Qwen3 / Qwen3-MoE attention with M-RoPE (DeepStack features
    # enter per token), tested against the ForConditionalGeneration forward.
    Family("qwen3_vl_text", "causal attention, M-RoPE"),
    Family("qwen3_vl_moe_text", "causal attention, M-RoPE, fused experts"),
    # Vision-language wrappers (their language models above).
    Family("qwen3_5", images=True),
    Family("qwen3_5_moe", images=True),
    Family("qwen3_vl", images=True),
    Family("qwen3_vl_moe", images=True),
)
_BY_TYPE = {f.model_type: f for f in FAMILIES}
assert len(_BY_TYPE) == len(FAMILIES), "a family is declared once"

PACKED = frozenset(f.model_type for f in FAMILIES if f.packed)
EXTERNAL_LORA = frozenset(f.model_type for f in FAMILIES if f.external_lora)
LLAMA_LAYERS = frozenset(f.model_type for f in FAMILIES if f.llama_layers)
IMAGES = frozenset(f.model_type for f in FAMILIES if f.images)


def family(model_type: str) -> Family:
    """The family of `model_type`; one this table does not name computes nothing special (the
    GENERIC path, no external LoRA, no Megatron layer, no images)."""
    return _BY_TYPE.get(model_type) or Family(model_type)


@dataclass(frozen=True)
class ModelConfig:
    """A model directory's `config.json`, read once."""

    directory: Path
    settings: dict[str, Any]  # the whole file (a wrapper's, for a vision-language model)

    @classmethod
    def read(cls, directory: str | Path) -> ModelConfig:
        directory = Path(directory).resolve()
        settings = json.loads((directory / "config.json").read_text())
        if not isinstance(settings, dict):
            raise ValueError(f"{directory}/config.json is not a JSON object")
        return cls(directory, settings)

    @property
    def text(self) -> dict[str, Any]:
        """The language model's settings (a multimodal config keeps them in `text_config`)."""
        text: dict[str, Any] = self.settings.get("text_config") or self.settings
        return text

    @property
    def family(self) -> Family:
        """The family the whole model is (its wrapper's, for a vision-language model)."""
        return family(str(self.settings.get("model_type", "unknown")))
