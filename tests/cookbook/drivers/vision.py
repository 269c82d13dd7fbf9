"""Images through tinker-cookbook (its venv, package unmodified) against `lockstep serve` of a
tiny Qwen3.5 vision-language model.

Usage: python vision.py '<json config>' with keys model (the served name, a local directory),
images (a local image folder: <class>/<file>.png), data_dir (the server's), log_dir, out (a
JSON file to write).

1. The cookbook's `qwen3_5` renderer and `conversation_to_datum` turn conversations of one image
   and a question into datums (their ImageChunks sized by `image_processing_utils.image_to_chunk`
   with the model's image processor); a LoRA trains on them through the SDK; a sampling client
   answers the renderer's generation prompt; their trainer and sampler logprobs are written,
   and the saved adapter is merged into the published checkpoint by the cookbook's
   `weights.build_hf_model`, whose own forward (this venv's transformers, the processor's pixels)
   gives the merged logprobs of the same datum.
2. vlm_classifier's dataset (`ClassifierDataset`: renderer, resize, flips) over the local image
   folder, trained by the cookbook's supervised loop (`supervised.train.main`, the loop the
   recipe's launcher runs). One substitution: `get_image_processor` is the model's processor
   built with transformers' PIL backend, because the venv's transformers 5.5.4 has no
   AutoImageProcessor without torchvision (which does not install beside its CPU torch).
"""

from __future__ import annotations

import asyncio
import io
import json
import sys
import time
from pathlib import Path

import chz
import tinker
import torch
from PIL import Image
from tinker import types
from tinker_cookbook import weights
from tinker_cookbook.recipes.vlm_classifier import data as classifier
from tinker_cookbook.renderers import ImagePart, Message, TextPart, TrainOnWhat, get_renderer
from tinker_cookbook.supervised import train
from tinker_cookbook.supervised.data import conversation_to_datum
from tinker_cookbook.supervised.types import SupervisedDataset, SupervisedDatasetBuilder
from tinker_cookbook.tokenizer_utils import get_tokenizer
from transformers import AutoModelForImageTextToText
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

QUESTION = "What colour is this?"


def conversations(images: Path) -> list[list[Message]]:
    out = []
    for path in sorted(images.glob("*/*.png")):
        with Image.open(path) as opened:
            picture = opened.convert("RGB")
        user = [ImagePart(type="image", image=picture), TextPart(type="text", text=QUESTION)]
        out.append(
            [
                Message(role="user", content=user),
                Message(role="assistant", content=path.parent.name),
            ]
        )
    return out


def renderer_flow(config: dict, processor: Qwen2VLImageProcessorPil) -> dict:
    model = config["model"]
    renderer = get_renderer("qwen3_5", get_tokenizer(model), processor)
    chats = conversations(Path(config["images"]))[::4]  # one image of each colour
    data = [
        conversation_to_datum(c, renderer, 512, TrainOnWhat.LAST_ASSISTANT_MESSAGE) for c in chats
    ]
    image_chunks = [c for c in data[0].model_input.chunks if isinstance(c, types.ImageChunk)]
    service = tinker.ServiceClient()
    trainer = service.create_lora_training_client(base_model=model, rank=8, seed=7).result()
    losses = []
    for _ in range(6):
        result = trainer.forward_backward(data, "cross_entropy").result()
        trainer.optim_step(types.AdamParams(learning_rate=5e-3)).result()
        losses.append(result.metrics["loss:sum"])
    forward = trainer.forward(data[:1], "cross_entropy").result()
    path = trainer.save_weights_for_sampler("cookbook-vision").result().path
    sampler = service.create_sampling_client(model_path=path).result()
    prompt = renderer.build_generation_prompt(chats[0][:1])
    greedy = types.SamplingParams(max_tokens=4, temperature=0.0, stop=renderer.get_stop_sequences())
    answer = sampler.sample(prompt, 1, greedy).result().sequences[0]
    scored = sampler.compute_logprobs(data[0].model_input).result()
    # The server keeps sampler weights under <data>/checkpoints/<run>/sampler_weights/<name>.
    run, _, name = path.removeprefix("tinker://").partition("/sampler_weights/")
    adapter = Path(config["data_dir"]) / "checkpoints" / run / "sampler_weights" / name
    merged = Path(config["log_dir"]) / "merged"
    weights.build_hf_model(
        base_model=model, adapter_path=str(adapter), output_path=str(merged), dtype="float32"
    )
    return {
        "merged_logprobs": merged_logprobs(merged, data[0], processor),
        "expected_tokens": [c.expected_tokens for c in image_chunks],
        "losses": losses,
        "sampler_path": path,
        "answer_tokens": answer.tokens,
        "compute_logprobs": scored[1:],
        # Positions whose target is the next input token (the datum targets 0 where its next
        # input is an image placeholder), where compute_logprobs scores the same token.
        "same_target": same_target(data[0]),
        "forward_logprobs": forward.loss_fn_outputs[0]["logprobs"].tolist(),
    }


def same_target(datum: tinker.Datum) -> list[int]:
    ids: list[int | None] = []
    for chunk in datum.model_input.chunks:
        if isinstance(chunk, types.ImageChunk):
            ids += [None] * (chunk.expected_tokens or 0)
        else:
            ids += list(chunk.tokens)
    targets = datum.loss_fn_inputs["target_tokens"].tolist()
    return [j for j in range(len(ids) - 1) if targets[j] == ids[j + 1]]


def merged_logprobs(
    directory: Path, datum: tinker.Datum, processor: Qwen2VLImageProcessorPil
) -> list[float]:
    """The datum's target logprobs under a merged checkpoint's own forward (HF's M-RoPE from
    mm_token_type_ids, pixels from the processor)."""
    model = AutoModelForImageTextToText.from_pretrained(str(directory), dtype=torch.float32)
    pad = model.config.image_token_id
    ids: list[int] = []
    pictures = []
    for chunk in datum.model_input.chunks:
        if isinstance(chunk, types.ImageChunk):
            assert chunk.expected_tokens is not None
            ids += [pad] * chunk.expected_tokens
            pictures.append(Image.open(io.BytesIO(chunk.data)))
        else:
            ids += list(chunk.tokens)
    pixels = processor(images=pictures, return_tensors="pt")
    tokens = torch.tensor([ids])
    with torch.no_grad():
        logits = model(
            input_ids=tokens,
            pixel_values=pixels["pixel_values"],
            image_grid_thw=pixels["image_grid_thw"],
            mm_token_type_ids=(tokens == pad).int(),
        ).logits[0]
    targets = torch.tensor(datum.loss_fn_inputs["target_tokens"].tolist())
    return logits.log_softmax(-1).gather(-1, targets[:, None])[:, 0].tolist()


@chz.chz
class LocalImages(SupervisedDatasetBuilder):
    """vlm_classifier's ClassifierDataset over a local image folder (its hub datasets cannot be
    fetched offline)."""

    folder: str
    model: str

    def __call__(self) -> tuple[SupervisedDataset, SupervisedDataset | None]:
        config = classifier.ClassifierDatasetConfig(
            dataset=self.folder,
            dataset_split="train",
            model_name_for_tokenizer=self.model,
            renderer_name="qwen3_5",
            batch_size=8,  # 16 images: 2 steps an epoch
            max_image_size=64,
        )
        return classifier.ClassifierDataset(config), None


def classifier_flow(config: dict, processor: Qwen2VLImageProcessorPil) -> None:
    classifier.get_image_processor = lambda name: processor  # type: ignore[assignment]
    run = train.Config(
        log_path=config["log_dir"],
        recipe_name="recipe_vlm_classifier",
        model_name=config["model"],
        renderer_name="qwen3_5",
        dataset_builder=LocalImages(folder=config["images"], model=config["model"]),
        learning_rate=5e-3,
        lr_schedule="constant",
        num_epochs=4,
        lora_rank=8,
        save_every=0,
        eval_every=0,
    )
    asyncio.run(train.main(run))


if __name__ == "__main__":
    cfg = json.loads(sys.argv[1])
    image_processor = Qwen2VLImageProcessorPil.from_pretrained(cfg["model"])
    started = time.monotonic()
    results = renderer_flow(cfg, image_processor)
    Path(cfg["out"]).write_text(json.dumps(results))
    print(f"renderer flow: {time.monotonic() - started:.1f}s", flush=True)
    started = time.monotonic()
    classifier_flow(cfg, image_processor)
    print(f"vlm_classifier loop: {time.monotonic() - started:.1f}s", flush=True)
