"""Merge Lockstep adapters of vision-language models into their published checkpoints with
tinker-cookbook's own `weights.build_hf_model` (cookbook venv, package unmodified), and score
rows with images under the merged model's own forward (this venv's transformers; pixels from
the model's image processor, its PIL backend; M-RoPE from mm_token_type_ids).

Usage: python vision_weights.py '<json config>' with key jobs, a list of objects with keys
base_model, adapter_path, out_dir and rows (each: ids, targets, images: PNG file paths in
order). Writes out_dir/logprobs.json: one list of target logprobs per row.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from PIL import Image
from tinker_cookbook import weights
from transformers import AutoModelForImageTextToText
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil


def run(job: dict) -> None:
    out = Path(job["out_dir"])
    weights.build_hf_model(
        base_model=job["base_model"],
        adapter_path=job["adapter_path"],
        output_path=str(out / "merged"),
        dtype="float32",
    )
    model = AutoModelForImageTextToText.from_pretrained(str(out / "merged"), dtype=torch.float32)
    processor = Qwen2VLImageProcessorPil.from_pretrained(job["base_model"])
    result = []
    for row in job["rows"]:
        pixels = processor(images=[Image.open(p) for p in row["images"]], return_tensors="pt")
        ids = torch.tensor([row["ids"]])
        with torch.no_grad():
            logits = model(
                input_ids=ids,
                pixel_values=pixels["pixel_values"],
                image_grid_thw=pixels["image_grid_thw"],
                mm_token_type_ids=(ids == model.config.image_token_id).int(),
            ).logits[0]
        targets = torch.tensor(row["targets"])[:, None]
        result.append(logits.log_softmax(-1).gather(-1, targets)[:, 0].tolist())
    (out / "logprobs.json").write_text(json.dumps(result))


if __name__ == "__main__":
    for job in json.loads(sys.argv[1])["jobs"]:
        run(job)
