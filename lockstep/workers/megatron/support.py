"""What the Megatron engine's layers compute exactly, read from a model's shape alone.

megatron-core's GPTModel (local spec) computes one kind of decoder layer: pre-norm RMSNorm,
softmax attention over grouped heads with RoPE over the whole head (optional q/k RMSNorm, q/k/v
biases, one sliding window switched on per layer), and a SwiGLU MLP or routed SwiGLU experts,
alike in every layer. Whatever else a model's shape (`engine.shape.ModelShape`) says it does is
refused by name (`Refused`), every such feature of a model in one message.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from enum import StrEnum

from lockstep.engine import families
from lockstep.engine.shape import AttentionShape, FeedForwardShape, Mixer, ModelShape

# Whether a family's decoder layer is Llama's is the family table's (`families.LLAMA_LAYERS`):
# a shape does not say it. Everything else is read from the shape.
SILU = frozenset({"silu"})


class Refused(StrEnum):
    """What megatron's layers would compute otherwise than the model."""

    LINEAR_ATTENTION = "linear-attention (Gated DeltaNet) layers"
    MAMBA = "Mamba-2 mixer layers"
    NO_ATTENTION = "feed-forward-only layers"
    NO_FFN = "attention-only layers"
    LATENT = "multi-head latent attention"
    SINKS = "attention sinks"
    WINDOW_SIZES = "sliding windows of different sizes"
    OUTPUT_GATE = "a gated attention output"
    OUTPUT_BIAS = "an attention output bias"
    VALUE_HEADS = "value heads wider or narrower than query/key heads"
    LAYER_SHAPES = "layers of different shapes"
    ROPE_SCALING = "RoPE scaling"
    PARTIAL_ROPE = "partial rotary embeddings"
    NO_ROPE = "attention without rotary embeddings"
    MLP_BIAS = "MLP or expert biases"
    ACTIVATION = "an activation other than SiLU"
    UNGATED = "gate-less MLPs or experts"
    MIXED_MOE = "dense layers mixed with MoE layers"
    SHARED_EXPERTS = "shared experts"
    DECODER_LAYER = "a decoder layer other than Llama's"


Found = list[tuple[Refused, str]]  # each refused feature, with a detail ("" when none)


class UnsupportedByMegatron(ValueError):
    """The model has features megatron's layers would not compute as the model does."""

    def __init__(self, family: str, found: Found) -> None:
        self.features = tuple(feature for feature, _ in found)
        named = "; ".join(f"{f.value} ({detail})" if detail else f.value for f, detail in found)
        super().__init__(
            f"the megatron engine cannot compute this {family!r} model exactly: {named} "
            "(serve it with the local engine)"
        )


def _mixers(shape: ModelShape) -> Found:
    mixers = shape.mixers()
    found = [
        (feature, "")
        for feature, mixer in (
            (Refused.LINEAR_ATTENTION, Mixer.LINEAR),
            (Refused.MAMBA, Mixer.MAMBA),
            (Refused.NO_ATTENTION, Mixer.NONE),
        )
        if mixer in mixers
    ]
    if any(la.attention is not None and la.ffn is None for la in shape.layers):
        found.append((Refused.NO_FFN, ""))
    return found


_ATTENTION: tuple[tuple[Refused, Callable[[AttentionShape], bool]], ...] = (
    (Refused.LATENT, lambda a: a.latent),
    (Refused.SINKS, lambda a: a.sinks),
    (Refused.OUTPUT_GATE, lambda a: a.output_gate),
    (Refused.OUTPUT_BIAS, lambda a: a.output_bias),
    (Refused.VALUE_HEADS, lambda a: a.value_head_dim != a.head_dim),
)


def _attention(shape: ModelShape) -> Found:
    att = shape.attention()
    found: Found = [(f, "") for f, has in _ATTENTION if any(has(a) for a in att)]
    windows = sorted({a.window for a in att if a.window})
    if len(windows) > 1:
        found.append((Refused.WINDOW_SIZES, ", ".join(map(str, windows))))
    if shape.rope != "default":
        found.append((Refused.ROPE_SCALING, repr(shape.rope)))
    if att and not shape.rotary_dim:
        found.append((Refused.NO_ROPE, ""))
    elif att and shape.rotary_dim != att[0].head_dim:
        found.append((Refused.PARTIAL_ROPE, f"{shape.rotary_dim} of {att[0].head_dim} dims"))
    return found


_FFN: tuple[tuple[Refused, Callable[[FeedForwardShape], bool]], ...] = (
    (Refused.MLP_BIAS, lambda f: f.bias),
    (Refused.UNGATED, lambda f: not f.gated),
    (Refused.SHARED_EXPERTS, lambda f: f.shared_width > 0),
)


def _feed_forward(shape: ModelShape) -> Found:
    ffns = [la.ffn for la in shape.layers if la.ffn is not None]
    found: Found = [(f, "") for f, has in _FFN if any(has(f) for f in ffns)]
    activations = sorted({f.activation for f in ffns} - SILU)
    if activations:
        found.append((Refused.ACTIVATION, ", ".join(activations)))
    routed = sum(1 for f in ffns if f.routed)
    if routed and routed != len(ffns):
        found.append((Refused.MIXED_MOE, f"{routed} of {len(ffns)} layers MoE"))
    return found


def _uniform(shape: ModelShape) -> Found:
    """Megatron builds every layer alike, the window aside (switched per layer)."""
    att = {replace(a, window=None) for a in shape.attention()}
    ffns = [la.ffn for la in shape.layers if la.ffn is not None]
    routed, dense = {f for f in ffns if f.routed}, {f for f in ffns if not f.routed}
    return [(Refused.LAYER_SHAPES, "")] if max(len(att), len(routed), len(dense)) > 1 else []


def refused_features(shape: ModelShape) -> Found:
    """Every feature of `shape` megatron's layers would not compute exactly."""
    found = _mixers(shape) + _attention(shape) + _uniform(shape) + _feed_forward(shape)
    if not families.family(shape.family).llama_layers:
        checked = ", ".join(sorted(families.LLAMA_LAYERS))
        found.append((Refused.DECODER_LAYER, f"checked: {checked}"))
    return found
