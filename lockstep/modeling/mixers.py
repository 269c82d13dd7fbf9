"""Stateful sequence mixers (Gated DeltaNet linear attention) run once per packed row.

A linear-attention layer carries a recurrent state and a short causal convolution along the
sequence; run over a packed micro-batch as one sequence, row i would start from row i - 1's
state. `run_per_row` makes such a module's forward run on each row's block of positions on its
own (state and convolution starting from zero, as for the row alone), with the LoRA routing
narrowed to that block, and concatenates the results. A block is the row's real tokens followed
by its alignment padding: the mixer is causal, so the trailing padding never reaches a real
token. Outside a packing the module runs as HF wrote it (the sampler, the generic path).

The module's own forward is kept (the instance's `forward` is wrapped), so its parameters keep
their names and its numbers stay the model's own.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from lockstep.modeling import packing

Narrow = Callable[[int, int], AbstractContextManager[None]]


def run_per_row(module: nn.Module, narrow: Narrow) -> None:
    """Wrap `module.forward` (hidden_states first, [B, T, H] -> [B, T, H']) to run per row.

    narrow(start, stop): a context routing positions start..stop-1 of the packed sequence as the
    whole input (the LoRA layers inside the module see only that block).
    """
    inner: Callable[..., torch.Tensor] = module.forward

    def forward(*args: Any, **kwargs: Any) -> torch.Tensor:
        layout = packing.current()
        if layout is None:
            return inner(*args, **kwargs)
        if "hidden_states" in kwargs:
            hidden, rest = kwargs.pop("hidden_states"), args
        else:
            hidden, rest = args[0], args[1:]
        if hidden.shape[0] != 1:
            raise ValueError("a packed micro-batch is one sequence")
        blocks = layout.blocks()
        # One split (its backward one concatenation), not a slice per block (each slice's
        # backward a zero-filled gradient of the whole sequence).
        pieces = torch.split(hidden, [width for _, width in blocks], dim=1)
        outs = []
        for (start, width), piece in zip(blocks, pieces, strict=True):
            with narrow(start, start + width):
                outs.append(inner(piece, *rest, **kwargs))
        return torch.cat(outs, dim=1)

    module.forward = forward
