"""Prompts with images in the local sampler: the prefill's input and the positions after it.

A prefill whose prompts carry images feeds the language model embeddings instead of token ids
(`VisionModel.inputs`: every image of the prefill through the tower in one call, embeddings at
their placeholders) and M-RoPE position ids [4, B, W]: the text positions the masks use, then
each prompt's own (t, h, w) positions (`vision/positions.py`), placed at its columns. After the
prompt every axis advances together from its largest position + 1: a generated token's position
is its index plus the prompt's `delta` (<= 0), what HF's `rope_deltas` hold.

The session prefix cache keys a prompt by its content: an image's placeholders by the image's
digest (two prompts whose tokens match but whose images differ share nothing), and a cached
prefix never ends inside an image (its rest would need part of an image's embeddings).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lockstep.engine.types import SampleRequest
from lockstep.modeling.vision.positions import mrope_positions, rope_delta
from lockstep.modeling.vision.tower import Placed, VisionModel


class PromptImages:
    def __init__(self, vision: VisionModel) -> None:
        self.vision = vision
        self.merge = vision.spec.merge_size

    def inputs(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        rows: Sequence[tuple[SampleRequest, int, int]],
    ) -> dict[str, Any] | None:
        """The decoder input of a prefill of `ids` [B, W] at text `positions` [B, W]; `rows`:
        per batch row, its request, the column of its first fed token and how many prompt
        tokens before it are cached (not fed). None: no image in the batch (ids suffice)."""
        if not any(req.images for req, _, _ in rows):
            return None
        mrope = positions.unsqueeze(0).expand(3, -1, -1).clone()
        placed = []
        for b, (req, column, skip) in enumerate(rows):
            if not req.images:
                continue
            full = mrope_positions(len(req.prompt), req.images, self.merge)[:, skip:]
            mrope[:, b, column : column + full.shape[1]] = full.to(mrope.device)
            placed += [
                Placed(b, column + i.position - skip, i) for i in req.images if i.position >= skip
            ]
        out = self.vision.inputs(ids, placed)
        out["position_ids"] = torch.cat([positions.unsqueeze(0), mrope])
        return out

    def delta(self, req: SampleRequest) -> int:
        return rope_delta(len(req.prompt), req.images, self.merge)


def prompt_key(req: SampleRequest) -> list[object]:
    """The prompt as the prefix cache compares it: tokens, and (digest, k) at the k-th
    placeholder of each image."""
    key: list[object] = list(req.prompt)
    for image in req.images:
        digest = image.digest
        for k in range(image.tokens):
            key[image.position + k] = (digest, k)
    return key


def whole_images(req: SampleRequest, length: int) -> int:
    """The longest prefix of at most `length` tokens that ends outside every image."""
    for image in req.images:
        if image.position < length < image.position + image.tokens:
            length = image.position
    return length
