"""Vision-language models in the local trainer, per family (tiny random models in the published
ForConditionalGeneration layout, `lockstep/modeling/vision/zoo.py`): logprobs equal transformers'
own forward with the processor's pixels and M-RoPE from `mm_token_type_ids`, at every position;
a different image changes them; a tenant with images alone == packed beside other image tenants
and a text tenant; SFT on image -> label lowers the loss."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from lockstep.engine.images import ImageInput, ImageLimits, ImageReader
from lockstep.engine.types import AdamConfig, Datum, LoraSpec, OptimRequest, PassRequest
from lockstep.modeling.vision import zoo as vision_zoo
from lockstep.modeling.vision.positions import mrope_positions
from lockstep.workers.local.trainer import LocalTrainingEngine

FAMILIES = sorted(vision_zoo.FAMILIES)
RED, BLUE, GREEN = (220, 20, 20), (20, 20, 220), (20, 200, 20)


def png(color: tuple[int, int, int], size: tuple[int, int] = (64, 48)) -> bytes:
    out = io.BytesIO()
    image = Image.new("RGB", size, color)
    image.putpixel((3, 5), (255, 255, 255))  # not a flat colour: patches differ
    image.save(out, format="PNG")
    return out.getvalue()


@pytest.fixture(scope="module", params=FAMILIES)
def engine(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> LocalTrainingEngine:
    cache = Path(tmp_path_factory.getbasetemp()) / "vision-zoo"
    directory = vision_zoo.ensure_family(request.param, cache)
    return LocalTrainingEngine(directory, vision_zoo.served_name(request.param), device="cpu")


def reader(engine: LocalTrainingEngine) -> ImageReader:
    return ImageReader(engine.card().vision, ImageLimits(1 << 20, 1 << 22))


def datum(
    engine: LocalTrainingEngine,
    images: list[bytes],
    text: tuple[list[int], ...] = ([5, 6, 7], [8, 9], [10, 11, 12]),
) -> Datum:
    """text[0] image text[1] image ... text[-1]; targets: the tokens shifted by one."""
    spec = engine.card().vision
    assert spec is not None
    tokens: list[int] = []
    found: list[ImageInput] = []
    for i, part in enumerate(text):
        tokens += part
        if i < len(images):
            image = reader(engine).image("c", images[i], "png", None, len(tokens))
            found.append(image)
            tokens += [spec.image_token_id] * image.tokens
    targets = tokens[1:] + [13]
    return Datum(
        np.asarray(tokens),
        {"target_tokens": np.asarray(targets), "weights": np.ones(len(tokens), np.float32)},
        tuple(found),
    )


def hf_pixels(directory: str, images: tuple[ImageInput, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """What transformers' own image processor (its PIL backend) makes of the images."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    processor = Qwen2VLImageProcessorPil.from_pretrained(directory)
    out = processor(images=[Image.open(io.BytesIO(i.data)) for i in images], return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


def forward(engine: LocalTrainingEngine, model_id: str, d: Datum) -> np.ndarray:
    req = PassRequest("f", model_id, "cross_entropy", {}, True, [d])
    out: np.ndarray = engine.run_passes([req])[0].outputs[0]["logprobs"]
    return out


def test_logprobs_equal_the_models_own_forward(engine: LocalTrainingEngine) -> None:
    from transformers import AutoModelForImageTextToText

    card = engine.card()
    spec = card.vision
    assert spec is not None
    engine.create_model("base", LoraSpec(rank=4, seed=3))  # B = 0: the base model's numbers
    d = datum(engine, [png(RED), png(BLUE, (96, 64))])
    ours = forward(engine, "base", d)
    model = AutoModelForImageTextToText.from_pretrained(card.directory, dtype=torch.float32)
    pixels, grid = hf_pixels(card.directory, d.images)
    ids = torch.as_tensor(d.tokens).unsqueeze(0)
    with torch.no_grad():
        logits = model(
            input_ids=ids,
            pixel_values=pixels,
            image_grid_thw=grid,
            mm_token_type_ids=(ids == spec.image_token_id).int(),
        ).logits[0]
    targets = torch.as_tensor(d.loss_inputs["target_tokens"]).unsqueeze(-1)
    theirs = torch.log_softmax(logits, -1).gather(-1, targets).squeeze(-1).numpy()
    assert np.abs(ours - theirs).max() <= 1e-5
    # A different image changes every position after it (and none before).
    other = forward(engine, "base", datum(engine, [png(GREEN), png(BLUE, (96, 64))]))
    first = d.images[0].position
    assert np.allclose(other[:first], ours[:first], atol=1e-6)
    assert np.abs(other[first:] - ours[first:]).max() > 1e-3
    engine.delete_model("base")


def test_mrope_positions_equal_the_models_rope_index(engine: LocalTrainingEngine) -> None:
    from transformers import AutoModelForImageTextToText

    card = engine.card()
    spec = card.vision
    assert spec is not None
    d = datum(engine, [png(RED, (33, 97)), png(BLUE, (128, 64))])
    model = AutoModelForImageTextToText.from_pretrained(card.directory, dtype=torch.float32)
    ids = torch.as_tensor(d.tokens).unsqueeze(0)
    grid = torch.tensor([i.grid for i in d.images])
    theirs, _ = model.model.get_rope_index(
        ids, mm_token_type_ids=(ids == spec.image_token_id).int(), image_grid_thw=grid
    )
    ours = mrope_positions(len(d.tokens), d.images, spec.merge_size)
    assert torch.equal(ours, theirs[:, 0])


def test_a_tenant_alone_equals_packed_beside_others(engine: LocalTrainingEngine) -> None:
    """Adapters trained a step first (B != 0), so every tenant's LoRA shapes its numbers."""
    for name, seed in (("a", 1), ("b", 2), ("t", 3)):
        engine.create_model(name, LoraSpec(rank=4, seed=seed))
    da, db = datum(engine, [png(RED)]), datum(engine, [png(BLUE), png(GREEN, (32, 96))])
    text = Datum(
        np.arange(3, 43),
        {"target_tokens": np.arange(4, 44), "weights": np.ones(40, np.float32)},
    )
    steps = [("a", da), ("b", db), ("t", text)]
    engine.run_passes([PassRequest(m, m, "cross_entropy", {}, False, [d]) for m, d in steps])
    engine.optim_step([OptimRequest(m, AdamConfig(learning_rate=1e-2)) for m, _ in steps])
    alone = [forward(engine, m, d) for m, d in steps]
    packed = engine.run_passes(
        [PassRequest(m, m, "cross_entropy", {}, True, [d]) for m, d in steps]
    )
    for lone, result in zip(alone, packed, strict=True):
        assert np.abs(lone - result.outputs[0]["logprobs"]).max() <= 1e-5
    for name, _ in steps:
        engine.delete_model(name)


def test_sft_on_image_to_label_lowers_the_loss(engine: LocalTrainingEngine) -> None:
    engine.create_model("sft", LoraSpec(rank=8, seed=4))
    red = datum(engine, [png(RED)], ([5, 6], [30]))  # red image -> 30
    blue = datum(engine, [png(BLUE)], ([5, 6], [31]))  # blue image -> 31
    for d, label in ((red, 30), (blue, 31)):
        d.loss_inputs["weights"][:] = 0
        d.loss_inputs["weights"][-2] = 1  # predict the label after the image
        d.loss_inputs["target_tokens"][-2] = label
    losses = []
    for _ in range(14):
        req = PassRequest("s", "sft", "cross_entropy", {}, False, [red, blue])
        losses.append(engine.run_passes([req])[0].metrics["loss:sum"])
        engine.optim_step([OptimRequest("sft", AdamConfig(learning_rate=5e-3))])
    assert losses[-1] < 0.2 * losses[0], losses
    # The label is read from the image: each image's own label beats the other one.
    for d, own, other in ((red, 30, 31), (blue, 31, 30)):
        scores = {}
        for label in (own, other):
            d.loss_inputs["target_tokens"][-2] = label
            scores[label] = forward(engine, "sft", d)[-2]
        assert scores[own] > scores[other], scores
    engine.delete_model("sft")


def test_adapters_target_the_language_model_under_the_text_names(
    engine: LocalTrainingEngine, tmp_path: Path
) -> None:
    """LoRA on the language model only, named as the text family names it (tinker-cookbook's
    merge adds `model.language_model.` back itself): no tower key, no published prefix."""
    from safetensors.torch import load_file

    engine.create_model("names", LoraSpec(rank=4, seed=5))
    engine.export_adapter("names", tmp_path)
    keys = list(load_file(str(tmp_path / "adapter_model.safetensors")))
    assert keys and all(
        k.startswith(("base_model.model.model.layers.", "base_model.model.lm_head.")) for k in keys
    ), keys[:5]
    engine.delete_model("names")


def test_the_sampler_answers_an_image_prompt_as_the_trainer_scores_it(
    engine: LocalTrainingEngine,
) -> None:
    """Greedy tokens equal HF `generate` with the same pixels; prompt and sampled logprobs
    equal the trainer's forward; a repeated image prompt reuses its session's prefix cache (the
    padded path), and the same tokens with another image reuse only the text before it."""
    from transformers import AutoModelForImageTextToText

    from lockstep.engine.types import SampleParams, SampleRequest
    from lockstep.rollout.local.sampler import LocalSamplingEngine

    card = engine.card()
    spec = card.vision
    assert spec is not None
    sampler = LocalSamplingEngine(Path(card.directory), card.name, device="cpu")
    d = datum(engine, [png(RED), png(BLUE, (96, 64))])
    prompt = d.tokens.tolist()

    def request(rid: str, images: tuple[ImageInput, ...], scores: bool = False) -> SampleRequest:
        params = SampleParams(max_tokens=5, temperature=0.0)
        return SampleRequest(
            rid, None, prompt, 1, params, prompt_logprobs=scores, cache_namespace="s", images=images
        )

    first = sampler.sample([request("a", d.images, scores=True)])[0]
    tokens = first.sequences[0].tokens
    model = AutoModelForImageTextToText.from_pretrained(card.directory, dtype=torch.float32)
    pixels, grid = hf_pixels(card.directory, d.images)
    ids = torch.as_tensor([prompt])
    generated = model.generate(
        input_ids=ids,
        pixel_values=pixels,
        image_grid_thw=grid,
        mm_token_type_ids=(ids == spec.image_token_id).int(),
        max_new_tokens=5,
        do_sample=False,
    )
    assert generated[0, len(prompt) :].tolist() == tokens
    engine.create_model("scorer", LoraSpec(rank=4, seed=3))  # B = 0: the base model
    sequence = prompt + tokens
    whole = Datum(
        np.asarray(sequence[:-1]),
        {
            "target_tokens": np.asarray(sequence[1:]),
            "weights": np.ones(len(sequence) - 1, np.float32),
        },
        d.images,
    )
    trainer = forward(engine, "scorer", whole)
    assert first.prompt_logprobs is not None
    assert np.abs(np.asarray(first.prompt_logprobs[1:]) - trainer[: len(prompt) - 1]).max() <= 1e-5
    sampled = np.asarray(first.sequences[0].logprobs)
    assert np.abs(sampled - trainer[len(prompt) - 1 :]).max() <= 1e-5
    engine.delete_model("scorer")
    if not sampler._lora.arch.padded_sampling:
        return  # the grouped path keeps no prefix cache
    sampler.sample([request("b", d.images)])  # cached now (prompt scores are never cached)
    _, reused = sampler.prefill_counts()
    again = sampler.sample([request("c", d.images)])[0]
    assert again.sequences[0].tokens == tokens
    assert sampler.prefill_counts()[1] - reused == len(prompt) - 1
    other = datum(engine, [png(GREEN), png(BLUE, (96, 64))])
    reused = sampler.prefill_counts()[1]
    sampler.sample([request("d", other.images)])
    assert sampler.prefill_counts()[1] - reused == other.images[0].position
