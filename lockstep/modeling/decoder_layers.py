"""What a decoder layer is made of, read from the loaded modules: which child is its token mixer
and which its feed-forward part, and each part's shape (`lockstep.engine.shape.LayerShape`).

What a layer's child is decides its role, not its name (Nemotron-H calls every block's module
`mixer`, its MoE blocks included): attention has a query projection and an `o_proj`, a
recurrent mixer is a known per-row mixer class or has a `conv1d`, a feed-forward part holds
fused experts or a `down_proj`. Experts stored in a layout no LoRA path knows are refused here.
"""

from __future__ import annotations

from torch import nn
from transformers import PreTrainedModel
from transformers.activations import ACT2CLS

from lockstep.engine.shape import (
    CUSTOM_ACTIVATION,
    AttentionShape,
    FeedForwardShape,
    LayerShape,
    Mixer,
    RecurrentShape,
)
from lockstep.errors import UnsupportedModel
from lockstep.modeling import transformers_range
from lockstep.modeling.experts import experts_layout, unreadable_flags

# Recurrent mixers the packed path runs exactly (`mixers.py`: a forward of its own from their
# parameters; their own forward takes the hidden states first and keeps no state without a cache).
ROW_MIXERS = {
    "Qwen3_5GatedDeltaNet": Mixer.LINEAR,
    "Qwen3_5MoeGatedDeltaNet": Mixer.LINEAR,
    "Qwen3NextGatedDeltaNet": Mixer.LINEAR,
    "NemotronHMamba2Mixer": Mixer.MAMBA,
}
# transformers' activation names for one function ("swish" is torch's nn.SiLU).
SAME_ACTIVATION = {"swish": "silu"}


def number(module: object, name: str, default: int | None = None) -> int:
    """An integer attribute transformers sets on a module or config (dynamic, so untyped)."""
    value = getattr(module, name, default)
    if value is None:
        raise UnsupportedModel(f"{type(module).__name__} has no {name}")
    return int(value)


def decoder_layers(model: PreTrainedModel) -> nn.ModuleList:
    layers = getattr(model.get_decoder(), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise UnsupportedModel(f"{type(model).__name__}: no decoder `layers` list")
    return layers


def module_path(model: nn.Module, target: nn.Module, what: str) -> str:
    path: str  # torch leaves named_modules' return unannotated
    for path, module in model.named_modules():
        if module is target:
            return path
    raise UnsupportedModel(f"{what} is not a submodule of the model")


# -- what a layer's child is ---------------------------------------------------------------


def is_attention(module: nn.Module) -> bool:
    query = any(hasattr(module, q) for q in ("q_proj", "q_a_proj", "q_b_proj"))
    return query and isinstance(getattr(module, "o_proj", None), nn.Linear)


def is_recurrent(module: nn.Module) -> bool:
    conv = getattr(module, "conv1d", None)
    return type(module).__name__ in ROW_MIXERS or isinstance(conv, nn.Conv1d)


def experts_in(module: nn.Module) -> nn.Module | None:
    for sub in module.modules():
        if experts_layout(sub) is not None:
            return sub
    return None


def is_feed_forward(module: nn.Module) -> bool:
    if is_attention(module) or is_recurrent(module):
        return False
    if experts_in(module) is not None:
        return True
    return isinstance(getattr(module, "down_proj", None), nn.Linear)


def refuse_unknown_experts(path: str, module: nn.Module) -> None:
    """3-D projection weights outside a known experts layout would train frozen: refuse them."""
    fused = [n for n, p in module.named_parameters(recurse=False) if p.dim() == 3 and "proj" in n]
    if not fused:
        return
    unknown = unreadable_flags()
    why = (
        f"it declares experts layout flags Lockstep does not compute: {unknown}"
        if unknown
        else "expected its fused gate_up_proj/down_proj with a gate, or up_proj/down_proj "
        "without one, and no post-expert norm"
    )
    raise UnsupportedModel(
        f"{path} ({type(module).__name__}): experts stored as {fused} in a layout Lockstep "
        f"cannot put LoRA on (transformers {transformers_range.installed()}: {why}; "
        f"tested: {transformers_range.REQUIREMENT})"
    )


# -- shapes --------------------------------------------------------------------------------


def layer_shape(layer: nn.Module, config: object, path: str, index: int) -> LayerShape:
    """The shape of decoder layer `index` (at module `path`), before its LoRA slots."""
    mixer, attention, recurrent, ffn = Mixer.NONE, None, None, None
    for name, child in layer.named_children():
        if is_attention(child):
            mixer, attention = Mixer.ATTENTION, _attention_shape(child, config, index)
        elif is_recurrent(child):
            mixer = ROW_MIXERS.get(type(child).__name__, Mixer.LINEAR)
            recurrent = _recurrent_shape(child)
        elif is_feed_forward(child):
            ffn = _ffn_shape(child, config)
        else:
            refuse_unknown_experts(f"{path}.{name}", child)
    return LayerShape(mixer=mixer, attention=attention, recurrent=recurrent, ffn=ffn)


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
    heads = number(config, "num_attention_heads")
    kv = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(module, "qk_head_dim", None) or number(module, "head_dim"))
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
        heads = number(module, "num_v_heads")
        state = number(module, "head_k_dim") * number(module, "head_v_dim")
    else:  # Mamba-2: head_dim x ssm_state_size per head
        heads = number(module, "num_heads", 1)
        state = number(module, "head_dim", 1) * number(module, "ssm_state_size", 1)
    return RecurrentShape(projected=projected, inner=out.in_features, heads=heads, state=state)


def _ffn_shape(module: nn.Module, config: object) -> FeedForwardShape:
    experts = experts_in(module)
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
    top_k = getattr(config, "num_experts_per_tok", None) or number(module, "top_k", 1)
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
