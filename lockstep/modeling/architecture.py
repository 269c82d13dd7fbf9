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
shared experts). What a layer's child is decides its role, not its name (Nemotron-H calls every
block's module `mixer`, its MoE blocks included).

Trainer paths (`lockstep.engine.shape.TrainerPath`):
- PACKED: a micro-batch's rows concatenated into one sequence, attention per row span
  (`attention.py`), recurrent mixers per row block (`mixers.py`). Used for the families listed
  in PACKED_FAMILIES, whose attention variants the row attention implements and whose equality
  with the model's own forward the test suite checks.
- GENERIC: any other causal LM transformers loads: every row runs through the model's own forward
  on its own (its own attention implementation and masks, no padding), with the same multi-LoRA
  layers. Slower, exact by construction; announced at load (a warning, `get_info`, a metric).

Sampler paths:
- padded: prompts left-padded into shared batches, KV cache row surgery (`rollout/local/kvcache`);
  only when every cache layer holds plain keys/values of every position (full attention, MLA).
- grouped: prompts of equal length batched without padding, HF's own per-layer caches (sliding
  windows, recurrent state); right for every architecture.

LoRA targets, by where a module sits in a decoder layer: every nn.Linear of the token mixer is
an attention target, every nn.Linear of the feed-forward part an MLP target except the routers
(`gate`, `router`, `shared_expert_gate`: Tinker trains experts, not routing), every fused experts
module an MLP target (per-expert w1/w3/w2; gate-less experts w1 = up, w2 = down), and the LM head
the unembed target. Each target carries Tinker's adapter name (`Target.name`, tinker-cookbook's
`weights/_merge_*.py`), which is what adapter files hold: gpt-oss's attention is `attn`, and a
fused projection Tinker trains as separate LoRA is split into row slices (`Target.parts`):
Qwen3.5's linear-attention `in_proj_qkv` as `in_proj_q` / `in_proj_k` / `in_proj_v`, a Mamba
mixer's `in_proj` as `gate_proj` (z) and `x_proj` (x; B, C and dt stay frozen).

A vision-language model's description plugs in as `Architecture.vision` (None for a text model):
the text decoder is described as above, the vision tower beside it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from enum import StrEnum
from pathlib import Path

import torch
from torch import nn
from transformers import DynamicCache, PreTrainedModel
from transformers.activations import ACT2CLS
from transformers.cache_utils import DynamicLayer

from lockstep.engine.images import VisionSpec
from lockstep.engine.shape import (
    CUSTOM_ACTIVATION,
    AttentionShape,
    FeedForwardShape,
    LayerShape,
    Mixer,
    ModelShape,
    RecurrentShape,
    TrainerPath,
)
from lockstep.modeling.experts import experts_layout

__all__ = ["TrainerPath", "Architecture", "describe", "describe_dir"]


class Role(StrEnum):
    ATTN = "attn"
    MLP = "mlp"
    UNEMBED = "unembed"


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
    "qwen3_next": "Gated DeltaNet + gated causal attention, fused and shared experts",
    "gpt_oss": "sliding-window and full attention with sinks, fused experts with biases",
    "deepseek_v3": "multi-head latent attention, dense and fused + shared experts",
    "nemotron_h": "Mamba-2 + causal attention, gate-less relu^2 experts + shared experts",
    # Qwen3-VL's language models: Qwen3 / Qwen3-MoE attention with M-RoPE (DeepStack features
    # enter per token), tested against the ForConditionalGeneration forward.
    "qwen3_vl_text": "causal attention, M-RoPE",
    "qwen3_vl_moe_text": "causal attention, M-RoPE, fused experts",
}
# Families an external sampling engine (vLLM, SGLang) serves with multi-LoRA as Lockstep trains
# them (every target the trainer adapts, same numbers): the dense ones. vLLM's MoE expert LoRA is
# experimental and its LoRA for linear-attention hybrids, sinks and MLA unverified; SGLang has
# no expert LoRA. `--sampler local` samples every family.
EXTERNAL_LORA_FAMILIES = frozenset({"llama", "qwen2", "qwen3"})
# Recurrent mixers the per-row wrapper runs exactly (their forward takes the hidden states first
# and keeps no state between calls without a cache).
ROW_MIXERS = {
    "Qwen3_5GatedDeltaNet": Mixer.LINEAR,
    "Qwen3_5MoeGatedDeltaNet": Mixer.LINEAR,
    "Qwen3NextGatedDeltaNet": Mixer.LINEAR,
    "NemotronHMamba2Mixer": Mixer.MAMBA,
}
ROUTERS = frozenset({"gate", "router", "shared_expert_gate"})
# transformers' activation names for one function ("swish" is torch's nn.SiLU).
SAME_ACTIVATION = {"swish": "silu"}
# Published vision-language checkpoints keep the text model under this prefix; adapters do not.
LANGUAGE_MODEL = "model.language_model."


def _number(module: object, name: str, default: int | None = None) -> int:
    """An integer attribute transformers sets on a module or config (dynamic, so untyped)."""
    value = getattr(module, name, default)
    if value is None:
        raise UnsupportedModel(f"{type(module).__name__} has no {name}")
    return int(value)


def _qwen3_5_qkv(module: nn.Module) -> tuple[tuple[str, int], ...]:
    key, value = _number(module, "key_dim"), _number(module, "value_dim")
    return (("in_proj_q", key), ("in_proj_k", key), ("in_proj_v", value))


def _mamba_in_proj(module: nn.Module) -> tuple[tuple[str, int], ...]:
    inner = _number(module, "intermediate_size")
    return (("gate_proj", inner), ("x_proj", inner))


# Fused projections Tinker trains as separate LoRA per row slice: mixer class -> (the fused
# linear's leaf name, its parts' names and widths from row 0; rows after the last part frozen).
SPLIT_PROJECTIONS: dict[str, tuple[str, Callable[[nn.Module], tuple[tuple[str, int], ...]]]] = {
    "Qwen3_5GatedDeltaNet": ("in_proj_qkv", _qwen3_5_qkv),
    "Qwen3_5MoeGatedDeltaNet": ("in_proj_qkv", _qwen3_5_qkv),
    "NemotronHMamba2Mixer": ("in_proj", _mamba_in_proj),
}
# Where Tinker's module names differ from transformers' (model_type -> path replacements).
ADAPTER_RENAMES = {"gpt_oss": ((".self_attn.", ".attn."),)}


@dataclass(frozen=True)
class LoraPart:
    """Rows start..stop-1 of a fused linear's output, trained as their own LoRA `name`."""

    name: str
    start: int
    stop: int


@dataclass(frozen=True)
class Target:
    path: str  # module path in the HF model
    role: Role
    module: nn.Module  # nn.Linear or a fused experts module
    name: str = ""  # Tinker's adapter path (what adapter files hold); "": the module path
    parts: tuple[LoraPart, ...] = ()  # non-empty: LoRA per row slice, under the parts' names

    def __post_init__(self) -> None:
        if not self.name:
            object.__setattr__(self, "name", self.path)


@dataclass(frozen=True)
class Architecture:
    shape: ModelShape
    padded_sampling: bool
    targets: tuple[Target, ...]
    row_mixers: tuple[str, ...]  # module paths run per packed row
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
        return self.shape.family in EXTERNAL_LORA_FAMILIES

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


def decoder_layers(model: PreTrainedModel) -> nn.ModuleList:
    layers = getattr(model.get_decoder(), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise UnsupportedModel(f"{type(model).__name__}: no decoder `layers` list")
    return layers


def _module_path(model: nn.Module, target: nn.Module, what: str) -> str:
    path: str  # torch leaves named_modules' return unannotated
    for path, module in model.named_modules():
        if module is target:
            return path
    raise UnsupportedModel(f"{what} is not a submodule of the model")


# -- what a layer's child is ---------------------------------------------------------------


def _is_attention(module: nn.Module) -> bool:
    query = any(hasattr(module, q) for q in ("q_proj", "q_a_proj", "q_b_proj"))
    return query and isinstance(getattr(module, "o_proj", None), nn.Linear)


def _is_recurrent(module: nn.Module) -> bool:
    conv = getattr(module, "conv1d", None)
    return type(module).__name__ in ROW_MIXERS or isinstance(conv, nn.Conv1d)


def _experts_in(module: nn.Module) -> nn.Module | None:
    for sub in module.modules():
        if experts_layout(sub) is not None:
            return sub
    return None


def _is_feed_forward(module: nn.Module) -> bool:
    if _is_attention(module) or _is_recurrent(module):
        return False
    if _experts_in(module) is not None:
        return True
    return isinstance(getattr(module, "down_proj", None), nn.Linear)


# -- shapes --------------------------------------------------------------------------------


def _window(module: nn.Module, config: object, index: int) -> int | None:
    """The layer's sliding window: the module's own setting where it keeps one (Qwen2, gpt-oss),
    else the config's for the layer (Mistral passes config.sliding_window to every layer)."""
    if hasattr(module, "sliding_window"):
        own = getattr(module, "sliding_window", None)
        return int(own) if own else None
    window = getattr(config, "sliding_window", None)
    kinds = getattr(config, "layer_types", None)
    if kinds and kinds[index] != "sliding_attention":
        return None
    return int(window) if window else None


def _attention_shape(module: nn.Module, config: object, index: int) -> AttentionShape:
    heads = _number(config, "num_attention_heads")
    kv = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(module, "qk_head_dim", None) or _number(module, "head_dim"))
    q, o = getattr(module, "q_proj", None), getattr(module, "o_proj", None)
    return AttentionShape(
        heads=heads,
        kv_heads=kv,
        head_dim=head_dim,
        value_head_dim=int(getattr(module, "v_head_dim", None) or head_dim),
        window=_window(module, config, index),
        sinks=isinstance(getattr(module, "sinks", None), nn.Parameter),
        latent=hasattr(module, "kv_a_proj_with_mqa"),
        qk_norm=hasattr(module, "q_norm") and hasattr(module, "k_norm"),
        bias=isinstance(q, nn.Linear) and q.bias is not None,
        output_bias=isinstance(o, nn.Linear) and o.bias is not None,
        # q_proj twice as wide as the heads: its second half gates the output (Qwen3.5 / Next)
        output_gate=isinstance(q, nn.Linear) and q.out_features == 2 * heads * head_dim,
    )


def _recurrent_shape(module: nn.Module) -> RecurrentShape:
    out = getattr(module, "out_proj", None)
    if not isinstance(out, nn.Linear):
        raise UnsupportedModel(f"{type(module).__name__}: a recurrent mixer without out_proj")
    linears = [m for m in module.modules() if isinstance(m, nn.Linear) and m is not out]
    projected = sum(m.out_features for m in linears)
    if hasattr(module, "head_k_dim"):  # Gated DeltaNet: a k x v state per value head
        heads = _number(module, "num_v_heads")
        state = _number(module, "head_k_dim") * _number(module, "head_v_dim")
    else:  # Mamba-2: head_dim x ssm_state_size per head
        heads = _number(module, "num_heads", 1)
        state = _number(module, "head_dim", 1) * _number(module, "ssm_state_size", 1)
    return RecurrentShape(projected=projected, inner=out.in_features, heads=heads, state=state)


def _ffn_shape(module: nn.Module, config: object) -> FeedForwardShape:
    experts = _experts_in(module)
    if experts is None:
        down = getattr(module, "down_proj", None)
        assert isinstance(down, nn.Linear)
        gated = hasattr(module, "gate_proj") or hasattr(module, "gate_up_proj")
        linears = [m for m in module.modules() if isinstance(m, nn.Linear)]
        return FeedForwardShape(
            width=down.in_features,
            gated=gated,
            bias=any(m.bias is not None for m in linears),
            activation=_activation(module),
        )
    layout = experts_layout(experts)
    down_proj = getattr(experts, "down_proj", None)
    assert isinstance(down_proj, nn.Parameter)
    count, a, b = down_proj.shape
    width = a if getattr(experts, "is_transposed", False) else b
    shared = 0
    for name in ("shared_expert", "shared_experts", "shared_mlp"):
        down = getattr(getattr(module, name, None), "down_proj", None)
        if isinstance(down, nn.Linear):
            shared += down.in_features
    top_k = getattr(config, "num_experts_per_tok", None) or _number(module, "top_k", 1)
    return FeedForwardShape(
        width=int(width),
        gated=layout == "gated",
        experts=int(count),
        top_k=int(top_k),
        shared_width=shared,
        bias=bool(getattr(experts, "has_bias", False)),
        activation=_activation(experts),
    )


def _activation(module: nn.Module) -> str:
    """transformers' name for the module's `act_fn` (CUSTOM_ACTIVATION when it has none)."""
    act = getattr(module, "act_fn", None)
    if act is None:
        return CUSTOM_ACTIVATION
    for name, cls in ACT2CLS.items():
        if type(act) is (cls[0] if isinstance(cls, tuple) else cls):
            return SAME_ACTIVATION.get(name, name)
    return type(act).__name__


def _layer(layer: nn.Module, config: object, path: str, index: int) -> LayerShape:
    mixer, attention, recurrent, ffn = Mixer.NONE, None, None, None
    for name, child in layer.named_children():
        if _is_attention(child):
            mixer, attention = Mixer.ATTENTION, _attention_shape(child, config, index)
        elif _is_recurrent(child):
            mixer = ROW_MIXERS.get(type(child).__name__, Mixer.LINEAR)
            recurrent = _recurrent_shape(child)
        elif _is_feed_forward(child):
            ffn = _ffn_shape(child, config)
        else:
            _refuse_unknown_experts(f"{path}.{name}", child)
    return LayerShape(mixer=mixer, attention=attention, recurrent=recurrent, ffn=ffn)


# -- targets -------------------------------------------------------------------------------


def text_path(path: str) -> str:
    """A module path of a vision-language model loaded whole (`model.language_model.*`) as the
    text model's (`model.*`): adapters name the language model's layers the same either way."""
    if path.startswith(LANGUAGE_MODEL):
        return "model." + path[len(LANGUAGE_MODEL) :]
    return path


def _adapter_name(family: str, path: str) -> str:
    path = text_path(path)
    for old, new in ADAPTER_RENAMES.get(family, ()):
        path = path.replace(old, new)
    return path


def _parts(child: nn.Module, leaf: str, name: str) -> tuple[LoraPart, ...]:
    split = SPLIT_PROJECTIONS.get(type(child).__name__)
    if split is None or split[0] != leaf:
        return ()
    parent = name.rsplit(".", 1)[0]
    parts, at = [], 0
    for part, width in split[1](child):
        parts.append(LoraPart(f"{parent}.{part}", at, at + width))
        at += width
    return tuple(parts)


def _targets(model: PreTrainedModel, family: str) -> list[Target]:
    layers = decoder_layers(model)
    prefix = _module_path(model, layers, "decoder layers")
    out: list[Target] = []
    for i, layer in enumerate(layers):
        for child_name, child in layer.named_children():
            role = Role.MLP if _is_feed_forward(child) else Role.ATTN
            base = f"{prefix}.{i}.{child_name}"
            for sub, module in child.named_modules():
                path = f"{base}.{sub}" if sub else base
                name = _adapter_name(family, path)
                leaf = path.rsplit(".", 1)[-1]
                if experts_layout(module) is not None:
                    out.append(Target(path, Role.MLP, module, name))
                elif isinstance(module, nn.Linear) and not (role is Role.MLP and leaf in ROUTERS):
                    if sub.count(".") == 0:
                        parts = _parts(child, leaf, name)
                    else:
                        parts = ()
                    out.append(Target(path, role, module, name, parts))
                else:
                    _refuse_unknown_experts(path, module)
    head = model.get_output_embeddings()
    if isinstance(head, nn.Linear):
        path = _module_path(model, head, "the LM head")
        out.append(Target(path, Role.UNEMBED, head, _adapter_name(family, path)))
    return out


def _refuse_unknown_experts(path: str, module: nn.Module) -> None:
    """3-D projection weights outside a known experts layout would train frozen: refuse them."""
    fused = [n for n, p in module.named_parameters(recurse=False) if p.dim() == 3 and "proj" in n]
    if fused:
        raise UnsupportedModel(
            f"{path} ({type(module).__name__}): experts stored as {fused} in a layout Lockstep "
            "cannot put LoRA on (expected transformers' fused gate_up_proj/down_proj with a "
            "gate, or up_proj/down_proj without one)"
        )


# -- the description -----------------------------------------------------------------------


def describe(model: PreTrainedModel, vision: VisionSpec | None = None) -> Architecture:
    """Classify a loaded model; raises UnsupportedModel naming what cannot be computed exactly.
    `vision`: the image processing of a vision-language model loaded whole (its card's)."""
    config = model.config.get_text_config(decoder=True)
    family = str(getattr(config, "model_type", "unknown"))
    layers = decoder_layers(model)
    prefix = _module_path(model, layers, "decoder layers")
    shapes = tuple(_layer(layer, config, f"{prefix}.{i}", i) for i, layer in enumerate(layers))
    targets = _targets(model, family)
    shapes = tuple(
        replace(shape, lora_slots=_slots(targets, f"{prefix}.{i}.", shape))
        for i, shape in enumerate(shapes)
    )
    mixers = tuple(
        f"{prefix}.{i}.{name}"
        for i, layer in enumerate(layers)
        for name, child in layer.named_children()
        if type(child).__name__ in ROW_MIXERS
    )
    recurrent = sum(1 for s in shapes if s.recurrent is not None)
    packed = family in PACKED_FAMILIES and recurrent == len(mixers)
    embeddings, head = model.get_input_embeddings(), model.get_output_embeddings()
    shape = ModelShape(
        family=family,
        hidden=_number(config, "hidden_size"),
        vocab=_number(config, "vocab_size"),
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


def _slots(targets: list[Target], prefix: str, shape: LayerShape) -> int:
    """LoRA projections one token passes in a layer: each linear target (or part of one), and
    each routed (token, expert) pair's expert projections."""
    slots = 0
    for t in targets:
        if not t.path.startswith(prefix):
            continue
        if isinstance(t.module, nn.Linear):
            slots += len(t.parts) or 1
        elif shape.ffn is not None:
            slots += shape.ffn.top_k * (3 if shape.ffn.gated else 2)
    return slots


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
