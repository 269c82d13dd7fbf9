"""The frozen vision tower of a loaded vision-language model, and how its output joins the
language model's input.

`VisionModel` wraps a transformers `ForConditionalGeneration` (Qwen3.5 / Qwen3.5-MoE, Qwen3-VL /
Qwen3-VL-MoE): the images of a whole batch (every tenant's rows of a micro-batch, every prompt of
a prefill) are processed together and go through the tower in ONE call of the model's own
`get_image_features` (each image attends only within itself, so an image's embeddings do not
depend on the others); the embeddings replace the placeholder tokens' embeddings at their
positions, and Qwen3-VL's deepstack features (added to the first decoder layers' output at the
image positions) travel beside them. The tower runs without autograd: it is frozen and LoRA
trains the language model only, so nothing flows back into it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn
from transformers import PreTrainedModel

from lockstep.engine.images import ImageInput, VisionSpec
from lockstep.engine.types import MemoryBudget
from lockstep.modeling.vision.positions import mrope_positions
from lockstep.modeling.vision.processing import ImageProcessing

# Families whose vision features also enter the first decoder layers (DeepStack).
DEEPSTACK = frozenset({"qwen3_vl", "qwen3_vl_moe"})


@dataclass(frozen=True)
class Placed:
    """An image in a batch: its placeholders start at column `start` of batch row `row`."""

    row: int
    start: int
    image: ImageInput


class VisionModel:
    def __init__(self, model: PreTrainedModel, model_dir: Path, spec: VisionSpec) -> None:
        self.spec = spec
        inner = model.get_submodule("model")
        tower = inner.get_submodule("visual")
        # The model's own: processes the pixels through the tower and its merger.
        self._image_features = cast(Callable[..., Any], inner.get_image_features)
        self._embed = model.get_input_embeddings()
        self._processing = ImageProcessing(model_dir)
        self._deepstack = spec.model_type in DEEPSTACK
        first = next(tower.parameters())
        self.device, self.dtype = first.device, first.dtype
        self.config = tower.config

    @torch.no_grad()
    def features(
        self, images: Sequence[ImageInput]
    ) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
        """Each image's embeddings [tokens, hidden] and, for DeepStack families, its feature of
        each deepstack layer: one tower call for all of them."""
        pixels, grid = self._processing.pixels(images)
        out = self._image_features(pixels.to(self.device), grid.to(self.device), return_dict=True)
        embeds = list(out.pooler_output)
        if not self._deepstack:
            return embeds, []
        # transformers >= 5.18 splits each deepstack layer's features per image; before, one
        # tensor of every image's tokens in order.
        sizes = [e.shape[0] for e in embeds]
        deep = [
            list(layer) if isinstance(layer, list | tuple) else list(torch.split(layer, sizes))
            for layer in out.deepstack_features
        ]
        return embeds, deep

    def inputs(self, input_ids: torch.Tensor, placed: Sequence[Placed]) -> dict[str, Any]:
        """The decoder's input for `input_ids` [B, T] with `placed` images: `inputs_embeds`
        (and DeepStack's `visual_pos_masks`, `deepstack_visual_embeds`)."""
        with torch.no_grad():
            embeds: torch.Tensor = self._embed(input_ids)
        if not placed:
            return {"inputs_embeds": embeds}
        order = sorted(placed, key=lambda p: (p.row, p.start))  # the placeholders' order
        feats, deep = self.features([p.image for p in order])
        mask = torch.zeros(input_ids.shape, dtype=torch.bool, device=input_ids.device)
        for p, feat in zip(order, feats, strict=True):
            span = slice(p.start, p.start + p.image.tokens)
            embeds[p.row, span] = feat.to(embeds.dtype)
            mask[p.row, span] = True
        out: dict[str, Any] = {"inputs_embeds": embeds}
        if deep:
            out["visual_pos_masks"] = mask
            out["deepstack_visual_embeds"] = [torch.cat(layer).to(embeds.dtype) for layer in deep]
        return out

    def packed(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        rows: Sequence[tuple[int, int, Sequence[ImageInput]]],
    ) -> dict[str, Any]:
        """The decoder's input for one packed micro-batch ([1, T] ids and per-row text
        positions; `rows`: (start, length, images) of each row): embeddings with every row's
        images in place, and position ids [4, 1, T], the text positions and each row's own
        M-RoPE (t, h, w)."""
        mrope = positions.expand(3, -1).clone()
        placed = []
        for start, length, images in rows:
            if images:
                row = mrope_positions(length, images, self.spec.merge_size)
                mrope[:, start : start + length] = row.to(mrope.device)
                placed += [Placed(0, start + i.position, i) for i in images]
        out = self.inputs(input_ids, placed)
        out["position_ids"] = torch.cat([positions, mrope]).unsqueeze(1).to(input_ids.device)
        return out

    def cost(self, element_bytes: int) -> VisionCost:
        return VisionCost.of(self.config, element_bytes, self.spec.merge_size)

    def budget(self, memory: MemoryBudget, budget_bytes: int, batch_tokens: int) -> MemoryBudget:
        """The trainer's budget with the largest image the tower's pass fits in it."""
        element = torch.finfo(self.dtype).bits // 8
        patches = self.cost(element).max_patches(budget_bytes, batch_tokens)
        return dataclasses.replace(memory, max_image_patches=patches)


def decoder_inputs(
    vision: VisionModel | None,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    rows: Sequence[tuple[int, int, Sequence[ImageInput]]],
) -> dict[str, Any]:
    """The language model's input for a packed micro-batch: ids and positions for a text
    model; a vision-language model's embeddings and M-RoPE (`VisionModel.packed`)."""
    if vision is None:
        return {"input_ids": input_ids, "position_ids": positions}
    return vision.packed(input_ids, positions, rows)


@dataclass(frozen=True)
class VisionCost:
    """Bytes the tower's pass holds for a micro-batch of P patches whose largest image has p:

        bytes = per_patch * P + scores * p^2

    per_patch: the fp32 pixels in, and e * (8 D + 2 I) of hidden states (D the tower's width, I
    its MLP width: residual, norm, q/k/v, attention output, MLP in and out); scores: fp32 scores
    and probabilities of one image's attention, 8 * heads. No autograd: one block at a time.
    A micro-batch holds at most merge^2 * its tokens patches."""

    per_patch: int
    scores: int
    merge_area: int

    @classmethod
    def of(cls, config: Any, element_bytes: int, merge: int) -> VisionCost:
        channels = int(config.in_channels) * int(config.temporal_patch_size)
        pixel = 4 * channels * int(config.patch_size) ** 2
        width = int(config.hidden_size)
        mlp = int(config.intermediate_size)
        return cls(
            per_patch=pixel + element_bytes * (8 * width + 2 * mlp),
            scores=8 * int(config.num_heads),
            merge_area=merge * merge,
        )

    def max_patches(self, budget_bytes: int, batch_tokens: int) -> int:
        """The largest image (patches) whose tower pass fits in `budget_bytes` beside a full
        micro-batch of images (0: none fits)."""
        low, high = 0, 1 << 24
        while low < high:
            mid = (low + high + 1) // 2
            total = max(mid, self.merge_area * batch_tokens)
            fits = self.per_patch * total + self.scores * mid * mid <= budget_bytes
            low, high = (mid, high) if fits else (low, mid - 1)
        return low


def vision_tower(model: PreTrainedModel) -> nn.Module:
    """The tower module of a loaded vision-language model."""
    return model.get_submodule("model.visual")
