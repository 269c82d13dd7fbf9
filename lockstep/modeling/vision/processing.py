"""An image's pixels as the served model's own image processor makes them.

The engine gets images encoded (`engine/images.py` says why) and processes them here with
transformers' PIL image processor built from the model's `preprocessor_config.json` (Qwen2-VL's,
which Qwen3-VL and Qwen3.5 use): resize, rescale, normalise and patchify are the processor's
own, so `pixel_values` and `image_grid_thw` are what `AutoImageProcessor` gives for the same
image (no torchvision needed). The grid must be the one the scheduler counted tokens from.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from lockstep.engine.images import ImageInput


class ImageProcessing:
    def __init__(self, model_dir: Path) -> None:
        self._processor = Qwen2VLImageProcessorPil.from_pretrained(str(model_dir))

    def pixels(self, images: Sequence[ImageInput]) -> tuple[torch.Tensor, torch.Tensor]:
        """(pixel_values [patches, C * t * p * p] fp32, image_grid_thw [images, 3]) of the
        images, in order."""
        decoded = []
        for image in images:
            with Image.open(io.BytesIO(image.data)) as opened:
                opened.load()
                decoded.append(opened.copy())
        out = self._processor(images=decoded, return_tensors="np")
        grid = np.asarray(out["image_grid_thw"], dtype=np.int64)
        for image, row in zip(images, grid, strict=True):
            if tuple(int(v) for v in row) != image.grid:
                raise RuntimeError(
                    f"the image processor made a {tuple(row)} grid where the scheduler counted "
                    f"{image.grid}: its settings and preprocessor_config.json disagree"
                )
        return torch.from_numpy(np.asarray(out["pixel_values"], np.float32)), torch.from_numpy(grid)
