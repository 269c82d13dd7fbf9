"""Row-wise attention for the trainer: each row attends over its own tokens only.

The trainer packs a micro-batch's rows into ONE sequence (`packing.py`). Every row then runs SDPA
on exactly its own tokens: no row is padded to another's length, no [heads, T, T] mask over the
whole micro-batch is built, and a row's result depends on nothing else in the batch. Positions
outside every row (alignment padding) get zeros. Why not HF's "sdpa" with a block-diagonal mask:
CPU SDPA picks its block sizes from the sequence length, so a row's numbers would depend on what
it is packed with.

The attention kinds of the packed families (`architecture.py`), each exact:
- causal (full) attention, grouped-query or not;
- a sliding window (`sliding_window=W`: a query sees itself and the W - 1 keys before it);
- learned sinks (`s_aux`, gpt-oss): a per-head logit added to the softmax denominator, computed
  as one extra key every query sees, with a zero value;
- multi-head latent attention (DeepSeek-V3): q/k head dim differs from the value head dim.

Without a packing (a forward outside `packed_rows`), each batch row is one causal sequence.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from lockstep.modeling import packing

ROW_ATTENTION = "lockstep_rows"


def _row(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scaling: float | None,
    window: int | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Attention of one row ([1, H, L, D]; K/V with H / groups heads) -> [L, H, Dv]."""
    heads, length = q.shape[1], q.shape[2]
    if k.shape[1] != heads:
        k, v = (t.repeat_interleave(heads // k.shape[1], dim=1) for t in (k, v))
    if sinks is None and (window is None or window >= length):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling)
        return out[0].transpose(0, 1)
    at = torch.arange(length, device=q.device)
    mask = at[None, :] <= at[:, None]  # [query, key]: causal
    if window is not None:
        mask &= at[None, :] > at[:, None] - window
    if sinks is not None:
        # One extra key per head: q gains a constant 1 column, the sink key is 0 there except
        # sink / scale, its value is 0, so it adds exp(sink) to the denominator and nothing else.
        scale = q.shape[-1] ** -0.5 if scaling is None else scaling
        q = torch.cat([q, q.new_ones(*q.shape[:-1], 1)], dim=-1)
        k = torch.cat([k, k.new_zeros(*k.shape[:-1], 1)], dim=-1)
        sink_key = k.new_zeros(1, heads, 1, k.shape[-1])
        sink_key[..., -1] = sinks.to(k.dtype).view(1, heads, 1) / scale
        k = torch.cat([sink_key, k], dim=2)
        v = torch.cat([v.new_zeros(1, heads, 1, v.shape[-1]), v], dim=2)
        mask = torch.cat([mask.new_ones(length, 1), mask], dim=1)
        scaling = scale
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling)
    return out[0].transpose(0, 1)


def row_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [B, H, S, D]
    key: torch.Tensor,  # [B, H_kv, S, D]
    value: torch.Tensor,  # [B, H_kv, S, Dv]
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """HF attention interface: returns [B, S, H, Dv]."""
    if dropout:
        raise NotImplementedError("attention dropout is not supported by the packed trainer")
    if kwargs.get("softcap") is not None:
        raise NotImplementedError("attention logit soft-capping is not supported by row attention")
    batch, heads, seq, _ = query.shape
    dim_v = value.shape[-1]
    layout = packing.current()
    if layout is None or batch != 1:
        rows = [
            _row(query[b : b + 1], key[b : b + 1], value[b : b + 1], scaling, sliding_window, s_aux)
            for b in range(batch)
        ]
        return torch.stack(rows), None
    parts, at = [], 0
    for start, length in layout.spans():
        if start > at:
            parts.append(query.new_zeros(start - at, heads, dim_v))
        q, k, v = (t[:, :, start : start + length] for t in (query, key, value))
        parts.append(_row(q, k, v, scaling, sliding_window, s_aux))
        at = start + length
    if at < seq:
        parts.append(query.new_zeros(seq - at, heads, dim_v))
    return torch.cat(parts).unsqueeze(0), None


AttentionInterface.register(ROW_ATTENTION, row_attention_forward)
