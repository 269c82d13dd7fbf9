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


# Two colours: the tiny random VLM tells them apart after ~12 steps (three take ~25).
COLOURS = {"red": (220, 30, 30), "blue": (30, 40, 220)}
VISION_DEMO_MODEL = "qwen3_vl"  # the tiny vision-language model `lockstep demo --vision` serves


def colour_image(rgb: tuple[int, int, int], seed: int) -> bytes:
    """A 64x64 PNG of one colour with a little noise (4 image tokens on the tiny VLMs)."""
    import io

    import numpy as np
    from PIL import Image

    noise = np.random.default_rng(seed).integers(-25, 25, (64, 64, 3))
    pixels = np.clip(np.asarray(rgb) + noise, 0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def colour_prompt(tokenizer: Any, image: bytes) -> Any:
    """A chat turn: the question, then the image; the assistant's turn opened."""
    from tinker import types

    question = "<|im_start|>user\nWhat colour is this?<|vision_start|>"
    return types.ModelInput(
        chunks=[
            types.EncodedTextChunk(tokens=tokenizer.encode(question)),
            types.ImageChunk(data=image, format="png", expected_tokens=4),
            types.EncodedTextChunk(
                tokens=tokenizer.encode("<|vision_end|><|im_end|>\n<|im_start|>assistant\n")
            ),
        ]
    )


def colour_data(tokenizer: Any) -> list[Any]:
    """Three images of each colour -> its name: the prompt weighted 0, the answer 1."""
    import numpy as np
    from tinker import types

    data = []
    for k, (name, rgb) in enumerate(COLOURS.items()):
        for seed in (3 * k, 3 * k + 1, 3 * k + 2):
            prompt = colour_prompt(tokenizer, colour_image(rgb, seed))
            answer = tokenizer.encode(f"{name}<|im_end|>")
            chunks = list(prompt.chunks)
            chunks.append(types.EncodedTextChunk(tokens=answer[:-1]))
            n = prompt.length + len(answer) - 1
            targets = [0] * (prompt.length - 1) + answer
            weights = [0.0] * (prompt.length - 1) + [1.0] * len(answer)
            data.append(
                types.Datum(
                    model_input=types.ModelInput(chunks=chunks),
                    loss_fn_inputs={
                        "target_tokens": types.TensorData.from_numpy(np.array(targets[:n])),
                        "weights": types.TensorData.from_numpy(np.array(weights[:n], np.float32)),
                    },
                )
            )
    return data
