"""What a base model is made of, and which of it Lockstep computes exactly: decided once, at load.

Every decoder layer has a token mixer (full or sliding-window attention, with or without sinks,
multi-head latent attention, Gated DeltaNet linear attention) and an MLP (dense, or experts as
fused 3-D parameters, with or without shared experts). `describe(model)` reads the loaded model
and returns an `Architecture`: the trainer path, the sampler path and the LoRA targets. A model
is never trained silently wrong: a feature no path computes exactly is refused here, by name.

Trainer paths:
- PACKED: a micro-batch's rows concatenated into one sequence, attention per row span
  (`attention.py`), linear-attention layers per row block (`mixers.py`). Used for the families
  listed in PACKED_FAMILIES, whose attention variants the row attention implements and whose
  equality with the model's own forward the test suite checks.
- GENERIC: any other causal LM transformers loads: every row runs through the model's own forward
  on its own (its own attention implementation and masks, no padding), with the same multi-LoRA
  layers. Slower, exact by construction.

Sampler paths:
- padded: prompts left-padded into shared batches, KV cache row surgery (`rollout/local/kvcache`);
  only when every cache layer holds plain keys/values of every position (full attention, MLA).
- grouped: prompts of equal length batched without padding, HF's own per-layer caches (sliding
  windows, recurrent state); right for every architecture.

LoRA targets, by where a module sits in a decoder layer (not by its name): every nn.Linear of
the token mixer is an attention target, every nn.Linear of the MLP an MLP target except the
routers (`gate`, `router`, `shared_expert_gate`: Tinker trains experts, not routing), every fused
experts module an MLP target (per-expert w1/w3/w2), and the LM head the unembed target.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import torch
from torch import nn
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from lockstep.modeling.experts import is_fused_experts


class Role(StrEnum):
    ATTN = "attn"
    MLP = "mlp"
    UNEMBED = "unembed"


class TrainerPath(StrEnum):
    PACKED = "packed"
    GENERIC = "generic"


class UnsupportedModel(ValueError):
    """The model has a feature Lockstep cannot compute exactly; the message names it."""


# model_type -> what the packed path handles there. Each is tested against the model's own
# forward (tests/unit/test_architectures.py).
PACKED_FAMILIES = {
    "llama": "causal attention",
    "qwen2": "causal attention (sliding windows when configured)",
    "qwen3": "causal attention",
    "qwen3_moe": "causal attention, fused experts",
    "qwen3_5_text": "Gated DeltaNet + gated causal attention",
    "qwen3_5_moe_text": "Gated DeltaNet + gated causal attention, fused and shared experts",
    "gpt_oss": "sliding-window and full attention with sinks, fused experts with biases",
    "deepseek_v3": "multi-head latent attention, dense and fused + shared experts",
    # Qwen3-VL's language models: Qwen3 / Qwen3-MoE attention with M-RoPE (DeepStack features
    # enter per token), tested against the ForConditionalGeneration forward.
    "qwen3_vl_text": "causal attention, M-RoPE",
    "qwen3_vl_moe_text": "causal attention, M-RoPE, fused experts",
}
# Linear-attention modules the per-row wrapper runs exactly (their forward takes the hidden
# states first and keeps no state between calls without a cache).
ROW_MIXERS = frozenset({"Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet"})
MLP_CONTAINERS = frozenset({"mlp", "feed_forward", "block_sparse_moe", "moe", "ffn"})
ROUTERS = frozenset({"gate", "router", "shared_expert_gate"})
FULL_ATTENTION = "full_attention"


@dataclass(frozen=True)
class Target:
    path: str  # module path in the HF model
    role: Role
    module: nn.Module  # nn.Linear or a fused experts module


@dataclass(frozen=True)
class Architecture:
    model_type: str
    layer_types: tuple[str, ...]
    trainer_path: TrainerPath
    padded_sampling: bool
    targets: tuple[Target, ...]
    row_mixers: tuple[str, ...]  # module paths run per packed row
    experts: tuple[str, ...]  # fused experts module paths

    def summary(self) -> str:
        kinds = ", ".join(sorted(set(self.layer_types)))
        moe = f", {len(self.experts)} MoE layers" if self.experts else ""
        return f"{self.model_type} ({kinds}{moe}): trainer {self.trainer_path.value} path"


def decoder_layers(model: PreTrainedModel) -> nn.ModuleList:
    layers = getattr(model.get_decoder(), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise UnsupportedModel(f"{type(model).__name__}: no decoder `layers` list")
    return layers


def _layer_prefix(model: PreTrainedModel, layers: nn.ModuleList) -> str:
    path: str  # torch leaves named_modules' return unannotated
    for path, module in model.named_modules():
        if module is layers:
            return path
    raise UnsupportedModel("decoder layers are not a submodule of the model")


def _targets(model: PreTrainedModel) -> list[Target]:
    layers = decoder_layers(model)
    prefix = _layer_prefix(model, layers)
    out: list[Target] = []
    for i, layer in enumerate(layers):
        for child_name, child in layer.named_children():
            role = Role.MLP if child_name in MLP_CONTAINERS else Role.ATTN
            base = f"{prefix}.{i}.{child_name}"
            for sub, module in child.named_modules():
                path = f"{base}.{sub}" if sub else base
                leaf = path.rsplit(".", 1)[-1]
                if is_fused_experts(module):
                    out.append(Target(path, Role.MLP, module))
                elif isinstance(module, nn.Linear) and not (role is Role.MLP and leaf in ROUTERS):
                    out.append(Target(path, role, module))
                else:
                    _refuse_unknown_experts(path, module)
    head = model.get_output_embeddings()
    if isinstance(head, nn.Linear):
        for path, module in model.named_modules():
            if module is head:
                out.append(Target(path, Role.UNEMBED, head))
    return out


def _refuse_unknown_experts(path: str, module: nn.Module) -> None:
    """3-D projection weights outside a known experts layout would train frozen: refuse them."""
    fused = [n for n, p in module.named_parameters(recurse=False) if p.dim() == 3 and "proj" in n]
    if fused:
        raise UnsupportedModel(
            f"{path} ({type(module).__name__}): experts stored as {fused} in a layout Lockstep "
            "cannot put LoRA on (expected transformers' fused gate_up_proj/down_proj with a gate)"
        )


def describe(model: PreTrainedModel) -> Architecture:
    """Classify a loaded model; raises UnsupportedModel naming what cannot be computed exactly."""
    config = model.config.get_text_config(decoder=True)
    model_type = str(getattr(config, "model_type", "unknown"))
    layers = decoder_layers(model)
    layer_types = tuple(getattr(config, "layer_types", None) or [FULL_ATTENTION] * len(layers))
    targets = _targets(model)
    prefix = _layer_prefix(model, layers)
    mixers = tuple(
        f"{prefix}.{i}.{name}"
        for i, layer in enumerate(layers)
        for name, child in layer.named_children()
        if type(child).__name__ in ROW_MIXERS
    )
    packed = model_type in PACKED_FAMILIES and _mixers_known(layer_types, len(mixers))
    return Architecture(
        model_type=model_type,
        layer_types=layer_types,
        trainer_path=TrainerPath.PACKED if packed else TrainerPath.GENERIC,
        padded_sampling=_plain_cache(model) and not _has_sinks(model),
        targets=tuple(targets),
        row_mixers=mixers if packed else (),
        experts=tuple(t.path for t in targets if is_fused_experts(t.module)),
    )


def _mixers_known(layer_types: tuple[str, ...], row_mixers: int) -> bool:
    known = {FULL_ATTENTION, "sliding_attention", "linear_attention"}
    linear = sum(t == "linear_attention" for t in layer_types)
    return set(layer_types) <= known and linear == row_mixers


def _plain_cache(model: PreTrainedModel) -> bool:
    """Every layer of the model's cache keeps plain keys and values of every past position (no
    window, no recurrent state): what left padding and row surgery keep exact."""
    cache = DynamicCache(config=model.config)
    return all(type(layer) is DynamicLayer for layer in cache.layers)


def _has_sinks(model: PreTrainedModel) -> bool:
    return any(name.endswith(".sinks") for name, _ in model.named_parameters())


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
