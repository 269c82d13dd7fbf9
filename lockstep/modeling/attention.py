"""Row-wise SDPA for the trainer: each row attends over its own length only, one SDPA call per row.

Why not HF's "sdpa" on the padded batch: CPU SDPA picks its block sizes from the (padded) sequence
length, so a row's numbers would depend on the longest row it is batched with — packing would
change a tenant's numbers. Here every row runs causal SDPA on exactly its own tokens (no mask, so
the flash kernels apply on CPU and GPU and no [heads, T, T] scores are kept for backward), and its
result depends on nothing else in the batch. Padding positions get zeros.

The engine names the rows' lengths with `row_lengths(...)` around the forward and the backward
(activation checkpointing recomputes attention during backward). A plain slot, not a ContextVar:
CUDA autograd runs backward on its own thread.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

ROW_ATTENTION = "lockstep_rows"


class _Lengths:
    current: list[int] | None = None


@contextmanager
def row_lengths(lengths: Sequence[int]) -> Iterator[None]:
    """Real tokens per batch row (right padding) for attention calls inside the context."""
    previous = _Lengths.current
    _Lengths.current = list(lengths)
    try:
        yield
    finally:
        _Lengths.current = previous


def row_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [B, H, S, D]
    key: torch.Tensor,  # [B, H_kv, S, D]
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """HF attention interface: returns [B, S, H, D]."""
    batch, heads, seq, dim = query.shape
    lengths = _Lengths.current
    if lengths is None or len(lengths) != batch:
        lengths = [seq] * batch
    groups = heads // key.shape[1]
    outs = []
    for b, length in enumerate(lengths):
        q, k, v = (t[b : b + 1, :, :length] for t in (query, key, value))
        if groups > 1:
            k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling)
        outs.append(F.pad(o[0].transpose(0, 1), (0, 0, 0, 0, 0, seq - length)))
    return torch.stack(outs), None


AttentionInterface.register(ROW_ATTENTION, row_attention_forward)
