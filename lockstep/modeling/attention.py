"""Row-wise SDPA for the trainer: each row attends over its own tokens only, one SDPA call per row.

The trainer packs a micro-batch's rows into ONE sequence ([1, T]: rows concatenated, positions
restarting at 0 for each row) and names each row's (start, length) with `row_spans(...)` around
the forward and the backward (activation checkpointing recomputes attention during backward).
Every row then runs causal SDPA on exactly its own tokens: no row is padded to another's length,
no mask is built (so the flash kernels apply on CPU and GPU and no [heads, T, T] scores are kept
for backward), and a row's result depends on nothing else in the batch. Positions outside every
span (alignment padding) get zeros. Why not HF's "sdpa" with a block-diagonal mask: CPU SDPA
picks its block sizes from the sequence length, so a row's numbers would depend on what it is
packed with.

Without spans (a forward outside `row_spans`), each batch row is one causal sequence.
A plain slot, not a ContextVar: CUDA autograd runs backward on its own thread.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

ROW_ATTENTION = "lockstep_rows"


class _Spans:
    current: list[tuple[int, int]] | None = None


@contextmanager
def row_spans(spans: Sequence[tuple[int, int]]) -> Iterator[None]:
    """(start, length) of each row packed in a [1, T] sequence, for attention inside the context."""
    previous = _Spans.current
    _Spans.current = list(spans)
    try:
        yield
    finally:
        _Spans.current = previous


def _causal(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int, scaling: float | None
) -> torch.Tensor:
    """Causal SDPA of one row ([1, H, L, D] each, K/V with H / groups heads) -> [L, H, D]."""
    if groups > 1:
        k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling)
    return out[0].transpose(0, 1)


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
    groups = heads // key.shape[1]
    spans = _Spans.current
    if spans is None or batch != 1:
        rows = [
            _causal(query[b : b + 1], key[b : b + 1], value[b : b + 1], groups, scaling)
            for b in range(batch)
        ]
        return torch.stack(rows), None
    parts, at = [], 0
    for start, length in spans:
        if start > at:
            parts.append(query.new_zeros(start - at, heads, dim))
        q, k, v = (t[:, :, start : start + length] for t in (query, key, value))
        parts.append(_causal(q, k, v, groups, scaling))
        at = start + length
    if at < seq:
        parts.append(query.new_zeros(seq - at, heads, dim))
    return torch.cat(parts).unsqueeze(0), None


AttentionInterface.register(ROW_ATTENTION, row_attention_forward)
