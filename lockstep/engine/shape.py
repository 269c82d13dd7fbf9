"""The shape of a base model as plain data: what its layers compute and how wide they are.

`lockstep.modeling.architecture` reads a loaded (or meta-device) model once and describes it
in these terms (`Architecture.shape`); everything that needs numbers about the model takes them
from here, never from `config.json` by key name: the pass-cost formula of memory admission
(`memory.PassCost.from_shape`), the Megatron converter's settings, the trainer path reported to
clients. Pure data, no torch: the engine leaf and the scheduler import it.

Each decoder layer has a token mixer (attention, Gated DeltaNet linear attention, a Mamba-2
mixer, or none: Nemotron-H's MoE blocks are layers of their own) and a feed-forward part (a
dense MLP, routed experts with or without shared experts, or none).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum


class TrainerPath(StrEnum):
    """How the local trainer runs a micro-batch (modeling/architecture.py says which)."""

    PACKED = "packed"  # rows packed into one sequence, per-row attention and state
    GENERIC = "generic"  # each row alone through the model's own forward: exact, slower


# FeedForwardShape.activation of a module that computes its activation inline.
CUSTOM_ACTIVATION = "custom"


class Mixer(StrEnum):
    ATTENTION = "attention"  # softmax attention (full, sliding window, sinks, MLA)
    LINEAR = "linear_attention"  # Gated DeltaNet: recurrent state + short convolution
    MAMBA = "mamba"  # Mamba-2 selective state space mixer
    NONE = "none"  # a feed-forward-only layer


@dataclass(frozen=True)
class AttentionShape:
    heads: int
    kv_heads: int
    head_dim: int  # query / key head width
    value_head_dim: int  # != head_dim for multi-head latent attention
    window: int | None = None  # sliding window (tokens a query sees, itself included)
    sinks: bool = False  # learned per-head sink logits (gpt-oss)
    latent: bool = False  # q / kv compressed through low-rank projections (MLA)
    qk_norm: bool = False  # per-head RMSNorm of q and k (Qwen3)
    bias: bool = False  # q/k/v projections carry biases
    output_bias: bool = False  # the output projection carries a bias
    output_gate: bool = False  # output gated by a sigmoid of a second query half (Qwen3.5)


@dataclass(frozen=True)
class RecurrentShape:
    """A linear-attention or Mamba mixer, per token: `projected` values out of its input
    projections, `inner` values into its output projection, `heads` x `state` recurrent state."""

    projected: int
    inner: int
    heads: int
    state: int  # state values per head


@dataclass(frozen=True)
class FeedForwardShape:
    """Dense MLP (`experts` == 0) or routed experts (+ shared experts of `shared_width`)."""

    width: int  # intermediate size of the dense MLP, or of one expert
    gated: bool  # gate * up (SwiGLU) rather than act(up) (relu^2)
    experts: int = 0
    top_k: int = 0
    shared_width: int = 0  # shared experts' (or a dense branch's) intermediate beside the experts
    bias: bool = False  # its projections (dense or expert) carry biases
    # transformers' name of the activation ("silu", "relu2", ...); CUSTOM_ACTIVATION where the
    # module computes its own inline (gpt-oss's clamped SwiGLU)
    activation: str = "silu"

    @property
    def routed(self) -> bool:
        return self.experts > 0


@dataclass(frozen=True)
class LayerShape:
    mixer: Mixer
    attention: AttentionShape | None = None
    recurrent: RecurrentShape | None = None
    ffn: FeedForwardShape | None = None
    lora_slots: int = 0  # LoRA projections a token passes in this layer (each routed pair's too)


@dataclass(frozen=True)
class ModelShape:
    family: str  # the language model's transformers model_type
    hidden: int
    vocab: int
    layers: tuple[LayerShape, ...]
    trainer_path: TrainerPath
    tied_embeddings: bool = False
    rope: str = "default"  # rotary embedding type ("default": plain RoPE)
    rotary_dim: int = 0  # query/key dims the model's rotary embedding turns (0: none found)
    head_slots: int = 0  # LoRA slots of the LM head (1 when it is a target)

    def attention(self) -> list[AttentionShape]:
        return [la.attention for la in self.layers if la.attention is not None]

    def moe_layers(self) -> int:
        return sum(1 for la in self.layers if la.ffn is not None and la.ffn.routed)

    def mixers(self) -> frozenset[Mixer]:
        return frozenset(la.mixer for la in self.layers)

    def shard(self, tp: int, pp: int) -> ModelShape:
        """One rank's share under tensor parallel `tp` and pipeline parallel `pp`: the largest
        stage's layers, heads, widths and vocabulary split over `tp` (whole experts stay whole:
        expert parallelism splits experts, not their width)."""

        def part(n: int) -> int:
            return max(n // tp, 1) if n else 0

        def one(layer: LayerShape) -> LayerShape:
            att, ffn = layer.attention, layer.ffn
            if att is not None:
                att = replace(att, heads=part(att.heads), kv_heads=part(att.kv_heads))
            if ffn is not None and not ffn.routed:
                ffn = replace(ffn, width=part(ffn.width))
            return replace(layer, attention=att, ffn=ffn)

        stage = -(-len(self.layers) // pp)
        layers = tuple(one(la) for la in self.layers[:stage])
        return replace(self, layers=layers, vocab=part(self.vocab))
