"""The demo's datasets: the Tinker docs' Pig Latin quickstart and a second, unrelated SFT task."""

from __future__ import annotations

from typing import Any

PIG_LATIN = [
    ("banana split", "anana-bay plit-say"),
    ("quantum physics", "uantum-qay ysics-phay"),
    ("donut shop", "onut-day op-shay"),
    ("pickle jar", "ickle-pay ar-jay"),
    ("space exploration", "ace-spay exploration-way"),
    ("rubber duck", "ubber-ray uck-day"),
    ("coding wizard", "oding-cay izard-way"),
]

CAPITALS = [
    ("France", "Paris"),
    ("Japan", "Tokyo"),
    ("Italy", "Rome"),
    ("Egypt", "Cairo"),
    ("Peru", "Lima"),
    ("Kenya", "Nairobi"),
]


def sft_data(tokenizer: Any, pairs: list[tuple[str, str]], template: str) -> list[Any]:
    """Datums for `template.format(x)` -> ` y`: prompt tokens weighted 0, completion 1."""
    import numpy as np
    from tinker import types

    data = []
    for source, target in pairs:
        prompt = tokenizer.encode(template.format(source), add_special_tokens=True)
        completion = tokenizer.encode(f" {target}\n\n", add_special_tokens=False)
        tokens = prompt + completion
        weights = [0.0] * len(prompt) + [1.0] * len(completion)
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={
                    "target_tokens": types.TensorData.from_numpy(np.array(tokens[1:], np.int64)),
                    "weights": types.TensorData.from_numpy(np.array(weights[1:], np.float32)),
                },
            )
        )
    return data


PIG_LATIN_TEMPLATE = "English: {}\nPig Latin:"
CAPITALS_TEMPLATE = "Capital of {}:"


def quickstart_data(tokenizer: Any) -> list[Any]:
    """The docs' Pig Latin datums: prompt tokens weighted 0, completion tokens weighted 1."""
    return sft_data(tokenizer, PIG_LATIN, PIG_LATIN_TEMPLATE)
