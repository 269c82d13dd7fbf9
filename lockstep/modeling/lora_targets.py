"""Which modules of a base model take LoRA, and under which of Tinker's adapter names.

By where a module sits in a decoder layer (`decoder_layers`): every nn.Linear of the token
mixer is an attention target, every nn.Linear of the feed-forward part an MLP target except the
routers (`gate`, `router`, `shared_expert_gate`: Tinker trains experts, not routing), every
fused experts module an MLP target (per-expert w1/w3/w2; gate-less experts w1 = up, w2 = down),
and the LM head the unembed target. Each target carries Tinker's adapter name (`Target.name`,
tinker-cookbook's `weights/_merge_*.py`), which is what adapter files hold: gpt-oss's attention
is `attn`, and a fused projection Tinker trains as separate LoRA is split into row slices
(`Target.parts`): Qwen3.5's linear-attention `in_proj_qkv` as `in_proj_q` / `in_proj_k` /
`in_proj_v`, a Mamba mixer's `in_proj` as `gate_proj` (z) and `x_proj` (x; B, C and dt stay
frozen).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from torch import nn
from transformers import PreTrainedModel

from lockstep.engine.shape import LayerShape
from lockstep.modeling.decoder_layers import (
    decoder_layers,
    is_feed_forward,
    module_path,
    number,
    refuse_unknown_experts,
)
from lockstep.modeling.experts import experts_layout


class Role(StrEnum):
    ATTN = "attn"
    MLP = "mlp"
    UNEMBED = "unembed"


ROUTERS = frozenset({"gate", "router", "shared_expert_gate"})
# Published vision-language checkpoints keep the text model under this prefix; adapters do not.
LANGUAGE_MODEL = "model.language_model."


def _qwen3_5_qkv(module: nn.Module) -> tuple[tuple[str, int], ...]:
    key, value = number(module, "key_dim"), number(module, "value_dim")
    return (("in_proj_q", key), ("in_proj_k", key), ("in_proj_v", value))


def _mamba_in_proj(module: nn.Module) -> tuple[tuple[str, int], ...]:
    inner = number(module, "intermediate_size")
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


def lora_targets(model: PreTrainedModel, family: str) -> list[Target]:
    """Every LoRA target of the model, decoder layers in order, then the LM head."""
    layers = decoder_layers(model)
    prefix = module_path(model, layers, "decoder layers")
    out: list[Target] = []
    for i, layer in enumerate(layers):
        for child_name, child in layer.named_children():
            role = Role.MLP if is_feed_forward(child) else Role.ATTN
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
                    refuse_unknown_experts(path, module)
    head = model.get_output_embeddings()
    if isinstance(head, nn.Linear):
        path = module_path(model, head, "the LM head")
        out.append(Target(path, Role.UNEMBED, head, _adapter_name(family, path)))
    return out


def lora_slots(targets: list[Target], prefix: str, shape: LayerShape) -> int:
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
