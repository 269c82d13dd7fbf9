"""What a base model is made of, and which of it Lockstep computes exactly: decided once, at load.

`describe(model)` reads a loaded model (`describe_dir` a meta-device instance built from a
directory's config, no weights) and returns its `Architecture`, the one description every
engine shares: the local trainer and sampler (paths, LoRA targets, per-row mixers), the Megatron
converter (`workers/megatron/model.py` takes its settings and refusals from it), memory admission
(`shape`, the pure-data `lockstep.engine.shape.ModelShape` the pass-cost formula reads) and the
external samplers' allowlist (`external_lora`). A model is never trained silently wrong: a
feature no path computes exactly is refused here, by name.

Every decoder layer has a token mixer (full or sliding-window attention, with or without sinks,
multi-head latent attention, Gated DeltaNet linear attention, a Mamba-2 mixer, or none) and a
feed-forward part (dense, or experts as fused 3-D parameters, gated or not, with or without
shared experts).

Trainer paths (`lockstep.engine.shape.TrainerPath`):
- PACKED: a micro-batch's rows concatenated into one sequence, attention per row span
  (`attention.py`), recurrent mixers with their state restarting at every row block, all rows
  in one call per kernel (`mixers.py`, `hybrid_kernels.py`). Used for the families whose
  attention variants the row attention implements and whose equality with the model's own
  forward the test suite checks (`engine/families.py`, `packed`).
- GENERIC: any other causal LM transformers loads: every row runs through the model's own forward
  on its own (its own attention implementation and masks, no padding), with the same multi-LoRA
  layers. Slower, exact by construction; announced at load (a warning, `get_info`, a metric).

Sampler paths:
- padded: prompts left-padded into shared batches, KV cache row surgery (`rollout/local/kvcache`);
  only when every cache layer holds plain keys/values of every position (full attention, MLA).
- grouped: prompts of equal length batched without padding, HF's own per-layer caches (sliding
  windows, recurrent state); right for every architecture.

What each part is made of comes from `decoder_layers.py` (a layer's children by role, and
their shapes); which modules take LoRA, under Tinker's adapter names, from `lora_targets.py`.

A vision-language model's description plugs in as `Architecture.vision` (None for a text model):
the text decoder is described as above, the vision tower beside it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from lockstep.engine import families
from lockstep.engine.images import VisionSpec
from lockstep.engine.shape import LayerShape, Mixer, ModelShape, TrainerPath
from lockstep.errors import UnsupportedModel
from lockstep.modeling.decoder_layers import (
    ROW_MIXERS,
    decoder_layers,
    layer_shape,
    module_path,
    number,
)
from lockstep.modeling.experts import experts_layout
from lockstep.modeling.lora_targets import Role, Target, lora_slots, lora_targets

__all__ = ["TrainerPath", "Architecture", "describe", "describe_dir"]


@dataclass(frozen=True)
class Architecture:
    shape: ModelShape
    padded_sampling: bool
    targets: tuple[Target, ...]
    row_mixers: tuple[str, ...]  # recurrent mixers' paths (`mixers.install` keeps rows apart)
    experts: tuple[str, ...]  # fused experts module paths
    # A vision-language model's image processing (None: text only, images refused by name).
    vision: VisionSpec | None = None

    @property
    def model_type(self) -> str:
        return self.shape.family

    @property
    def trainer_path(self) -> TrainerPath:
        return self.shape.trainer_path

    @property
    def external_lora(self) -> bool:
        """Whether vLLM / SGLang serve this family's adapters as the trainer computes them."""
        return families.family(self.shape.family).external_lora

    @property
    def layer_types(self) -> tuple[str, ...]:
        return tuple(_kind(layer) for layer in self.shape.layers)

    def summary(self) -> str:
        kinds = ", ".join(sorted(set(self.layer_types)))
        moe = f", {len(self.experts)} MoE layers" if self.experts else ""
        images = f", images ({self.vision.model_type} vision tower)" if self.vision else ""
        return f"{self.model_type} ({kinds}{moe}{images}): trainer {self.trainer_path.value} path"


def _kind(layer: LayerShape) -> str:
    if layer.attention is not None:
        return "sliding_attention" if layer.attention.window else "full_attention"
    if layer.mixer is Mixer.NONE:
        return "moe" if layer.ffn is not None and layer.ffn.routed else "mlp"
    return layer.mixer.value


def describe(model: PreTrainedModel, vision: VisionSpec | None = None) -> Architecture:
    """Classify a loaded model; raises UnsupportedModel naming what cannot be computed exactly.
    `vision`: the image processing of a vision-language model loaded whole (its card's)."""
    config = model.config.get_text_config(decoder=True)
    family = str(getattr(config, "model_type", "unknown"))
    layers = decoder_layers(model)
    prefix = module_path(model, layers, "decoder layers")
    shapes = tuple(layer_shape(layer, config, f"{prefix}.{i}", i) for i, layer in enumerate(layers))
    targets = lora_targets(model, family)
    shapes = tuple(
        replace(shape, lora_slots=lora_slots(targets, f"{prefix}.{i}.", shape))
        for i, shape in enumerate(shapes)
    )
    mixers = tuple(
        f"{prefix}.{i}.{name}"
        for i, layer in enumerate(layers)
        for name, child in layer.named_children()
        if type(child).__name__ in ROW_MIXERS
    )
    recurrent = sum(1 for s in shapes if s.recurrent is not None)
    packed = families.family(family).packed != "" and recurrent == len(mixers)
    embeddings, head = model.get_input_embeddings(), model.get_output_embeddings()
    shape = ModelShape(
        family=family,
        hidden=number(config, "hidden_size"),
        vocab=number(config, "vocab_size"),
        layers=shapes,
        trainer_path=TrainerPath.PACKED if packed else TrainerPath.GENERIC,
        tied_embeddings=isinstance(head, nn.Module) and head.weight is embeddings.weight,
        rope=_rope_type(config),
        rotary_dim=_rotary_dim(model),
        head_slots=sum(1 for t in targets if t.role is Role.UNEMBED),
    )
    return Architecture(
        shape=shape,
        padded_sampling=_plain_cache(model) and not any(a.sinks for a in shape.attention()),
        targets=tuple(targets),
        row_mixers=mixers if packed else (),
        experts=tuple(t.path for t in targets if experts_layout(t.module) is not None),
        vision=vision,
    )


def describe_dir(model_dir: Path) -> Architecture:
    """The Architecture of a model directory without its weights (a meta-device instance of its
    config): what processes that never load the model (Megatron, configuration checks) use."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_dir))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return describe(model)


def _rope_type(config: object) -> str:
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if isinstance(rope, dict):
        return str(rope.get("rope_type") or rope.get("type") or "default")
    return "default"


def _rotary_dim(model: PreTrainedModel) -> int:
    """Query/key dims the decoder's rotary embedding turns: twice its inverse frequencies (fewer
    than a head's under partial_rotary_factor); 0 without a decoder-level rotary embedding."""
    inv_freq = getattr(getattr(model.get_decoder(), "rotary_emb", None), "inv_freq", None)
    return 2 * inv_freq.shape[-1] if isinstance(inv_freq, torch.Tensor) else 0


def _plain_cache(model: PreTrainedModel) -> bool:
    """Every layer of the model's cache keeps plain keys and values of every past position (no
    window, no recurrent state): what left padding and row surgery keep exact."""
    cache = DynamicCache(config=model.config)
    return all(type(layer) is DynamicLayer for layer in cache.layers)


def check_head(model: PreTrainedModel, vocab: int) -> None:
    """The trainer computes logits as the LM head of the decoder's last hidden state (in chunks,
    never [T, V] at once). Refuse a model whose own logits are anything else (soft-capping,
    logit scaling): its logprobs would be silently wrong."""
    device = next(model.parameters()).device
    ids = (torch.arange(8, device=device) * 7 + 3).remainder(vocab).unsqueeze(0)
    head = model.get_output_embeddings()
    assert isinstance(head, nn.Module)
    with torch.no_grad():
        own = model(input_ids=ids, use_cache=False).logits.float()
        ours = head(model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state).float()
    if not torch.allclose(own, ours, rtol=1e-4, atol=1e-4):
        cap = getattr(model.config, "final_logit_softcapping", None)
        detail = f" (final_logit_softcapping={cap})" if cap else ""
        raise UnsupportedModel(
            f"{type(model).__name__}: its logits are not the LM head of the decoder output"
            f"{detail}; Lockstep's chunked logprobs would differ from the model's own"
        )
