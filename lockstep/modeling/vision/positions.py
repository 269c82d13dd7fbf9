"""M-RoPE's 3-D positions (temporal, height, width) of one row, as Qwen's `get_rope_index`
computes them: text continues one position per token on all three axes; an image's merged
patches take the position where it starts on the temporal axis and that start plus their row /
column on the other two, and the text after it resumes at the start plus the image's larger
side. Computed per row from the row alone, so a row's positions never depend on what it is
packed with; a row without images gets 0..L-1 on every axis (plain RoPE)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lockstep.engine.images import ImageInput


def mrope_positions(length: int, images: Sequence[ImageInput], merge: int) -> torch.Tensor:
    """[3, length] int64 positions of a row of `length` tokens with `images` at their places."""
    out = torch.empty(3, length, dtype=torch.long)
    at = 0  # next token of the row
    pos = 0  # next position
    for image in sorted(images, key=lambda i: i.position):
        text = image.position - at
        out[:, at : image.position] = torch.arange(pos, pos + text)
        pos += text
        t, h, w = image.grid[0], image.grid[1] // merge, image.grid[2] // merge
        grid_t, grid_h, grid_w = torch.meshgrid(
            torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij"
        )
        span = slice(image.position, image.position + image.tokens)
        out[0, span] = grid_t.reshape(-1) + pos
        out[1, span] = grid_h.reshape(-1) + pos
        out[2, span] = grid_w.reshape(-1) + pos
        pos += max(h, w)
        at = image.position + image.tokens
    out[:, at:] = torch.arange(pos, pos + length - at)
    return out


def rope_delta(length: int, images: Sequence[ImageInput], merge: int) -> int:
    """How far the position after the row's last token is from `length` (<= 0): generated
    tokens take position (their index) + delta on every axis."""
    if not images:
        return 0
    return int(mrope_positions(length, images, merge).max()) + 1 - length
