"""The Megatron converter refuses, by name, every feature its layers would compute otherwise than
the model, reading only the model's shape (pure data: no weights, no processes).

Each case changes one thing of a Qwen3-like shape the converter takes, and must be refused with
exactly that feature; every `Refused` member has a case.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

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
from lockstep.modeling import zoo
from lockstep.workers.megatron.model import HFArch
from lockstep.workers.megatron.support import Refused, UnsupportedByMegatron, refused_features

ATT = AttentionShape(heads=4, kv_heads=2, head_dim=16, value_head_dim=16, qk_norm=True)
MLP = FeedForwardShape(width=128, gated=True)
MOE = FeedForwardShape(width=48, gated=True, experts=8, top_k=2)
LAYER = LayerShape(Mixer.ATTENTION, attention=ATT, ffn=MLP)
BASE = ModelShape("qwen3", 64, 1024, (LAYER, LAYER), TrainerPath.PACKED, rotary_dim=16)
RECURRENT = RecurrentShape(projected=256, inner=64, heads=4, state=256)


def _attention(**changes: object) -> ModelShape:
    """Every layer's attention changed."""
    att = replace(ATT, **changes)  # type: ignore[arg-type]
    return replace(BASE, layers=tuple(replace(la, attention=att) for la in BASE.layers))


def _ffn(ffn: FeedForwardShape, family: str = "qwen3") -> ModelShape:
    return replace(BASE, family=family, layers=tuple(replace(la, ffn=ffn) for la in BASE.layers))


def _layers(*layers: LayerShape) -> ModelShape:
    return replace(BASE, layers=layers)


def _second(layer: LayerShape) -> ModelShape:
    """The second layer replaced."""
    return _layers(LAYER, layer)


def _windowed(window: int) -> LayerShape:
    return replace(LAYER, attention=replace(ATT, window=window))


CASES: dict[Refused, Callable[[], ModelShape]] = {
    Refused.LINEAR_ATTENTION: lambda: _second(
        LayerShape(Mixer.LINEAR, recurrent=RECURRENT, ffn=MLP)
    ),
    Refused.MAMBA: lambda: _second(LayerShape(Mixer.MAMBA, recurrent=RECURRENT, ffn=MLP)),
    Refused.NO_ATTENTION: lambda: _second(LayerShape(Mixer.NONE, ffn=MLP)),
    Refused.NO_FFN: lambda: _second(replace(LAYER, ffn=None)),
    Refused.LATENT: lambda: _attention(latent=True),
    Refused.SINKS: lambda: _attention(sinks=True),
    Refused.WINDOW_SIZES: lambda: _layers(_windowed(16), _windowed(8)),
    Refused.OUTPUT_GATE: lambda: _attention(output_gate=True),
    Refused.OUTPUT_BIAS: lambda: _attention(output_bias=True),
    Refused.VALUE_HEADS: lambda: _attention(value_head_dim=8),
    Refused.LAYER_SHAPES: lambda: _second(replace(LAYER, attention=replace(ATT, kv_heads=4))),
    Refused.ROPE_SCALING: lambda: replace(BASE, rope="yarn"),
    Refused.PARTIAL_ROPE: lambda: replace(BASE, rotary_dim=4),
    Refused.NO_ROPE: lambda: replace(BASE, rotary_dim=0),
    Refused.MLP_BIAS: lambda: _ffn(replace(MOE, bias=True), "qwen3_moe"),
    Refused.ACTIVATION: lambda: _ffn(replace(MLP, activation="gelu_pytorch_tanh")),
    Refused.UNGATED: lambda: _ffn(replace(MOE, gated=False), "qwen3_moe"),
    Refused.MIXED_MOE: lambda: replace(
        BASE, family="qwen3_moe", layers=(LAYER, replace(LAYER, ffn=MOE))
    ),
    Refused.SHARED_EXPERTS: lambda: _ffn(replace(MOE, shared_width=48), "qwen3_moe"),
    Refused.DECODER_LAYER: lambda: replace(BASE, family="gemma3_text"),
}


def test_the_base_shapes_convert() -> None:
    for shape in (BASE, _ffn(MOE, "qwen3_moe"), _attention(window=16)):
        assert refused_features(shape) == []
        HFArch.from_shape(shape, {})
    alternating = _second(_windowed(16))
    arch = HFArch.from_shape(alternating, {})
    assert (arch.window, arch.windowed) == (16, (False, True))


def test_every_refused_feature_has_a_case() -> None:
    assert set(CASES) == set(Refused)


@pytest.mark.parametrize("feature", list(Refused))
def test_each_feature_is_refused_by_name(feature: Refused) -> None:
    shape = CASES[feature]()
    assert [f for f, _ in refused_features(shape)] == [feature]
    named = re.escape(f"exactly: {feature.value}")
    with pytest.raises(UnsupportedByMegatron, match=named) as refusal:
        HFArch.from_shape(shape, {})
    assert refusal.value.features == (feature,)


def test_custom_activations_are_refused_too() -> None:
    shape = _ffn(replace(MOE, activation=CUSTOM_ACTIVATION), "qwen3_moe")
    assert [f for f, _ in refused_features(shape)] == [Refused.ACTIVATION]


def test_zoo_families_are_refused_with_all_their_features() -> None:
    """The tiny published families megatron cannot convert, read from their own configs."""
    cache = Path.home() / ".cache" / "lockstep-test-models"
    expected = {
        "gpt_oss": {Refused.SINKS, Refused.OUTPUT_BIAS, Refused.MLP_BIAS, Refused.ACTIVATION},
        "deepseek_v3": {Refused.LATENT, Refused.ROPE_SCALING, Refused.SHARED_EXPERTS},
        "qwen3_next": {Refused.LINEAR_ATTENTION, Refused.OUTPUT_GATE, Refused.PARTIAL_ROPE},
        "nemotron_h": {Refused.MAMBA, Refused.NO_ROPE, Refused.UNGATED, Refused.ACTIVATION},
    }
    for family, features in expected.items():
        with pytest.raises(UnsupportedByMegatron) as refusal:
            HFArch.from_dir(zoo.ensure_family(family, cache))
        assert features <= set(refusal.value.features), family
        assert Refused.DECODER_LAYER in refusal.value.features
