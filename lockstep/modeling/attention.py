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

VARLEN (CUDA): every row of a packed sequence in ONE variable-length flash-attention call
(`torch.nn.attention.varlen`), each row's block (its tokens, then its alignment padding) one
sequence: causal, so a row's real tokens never see its padding, and with a window where the
layer has one. It takes fp16 / bf16 and no sinks; a value head narrower than the q/k head (MLA)
is zero-padded to it for the call and the output cut back (exact: zero value columns add
nothing to the real ones, and their gradient is dropped). Anything else, and every CPU, runs the
per-row loop. Off until benchmarks/gpu_suite.py shows it equal (bf16 tolerance) and faster on a
GPU (`VARLEN`).
"""

from __future__ import annotations

import functools
import inspect
import itertools
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from lockstep.modeling import packing

ROW_ATTENTION = "lockstep_rows"
# One varlen flash-attention call per packed sequence where it applies (module docstring).
VARLEN = False
# Devices whose varlen kernel runs (torch's flash kernel: CUDA). The op census adds the CPU with
# a stand-in kernel, to count what a GPU cycle launches (`modeling.op_census`).
VARLEN_DEVICES = frozenset({"cuda"})


def _varlen_kernel() -> Callable[..., torch.Tensor] | None:
    """torch's varlen attention, if this torch has it."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return cast(Callable[..., torch.Tensor], varlen_attn)  # without return_aux: one tensor


_VARLEN_KERNEL = _varlen_kernel()
# Its signature moved between torch releases: `is_causal=` (2.9/2.10), `window_size=(left, 0)`
# for causal after; GQA without repeated K/V heads only where it says so.
_VARLEN_PARAMS = (
    frozenset(inspect.signature(_VARLEN_KERNEL).parameters) if _VARLEN_KERNEL else frozenset()
)


def varlen_takes(
    query: torch.Tensor, value: torch.Tensor, window: int | None, sinks: torch.Tensor | None
) -> bool:
    """Whether the varlen kernel computes this layer's attention (module docstring)."""
    return (
        VARLEN
        and _VARLEN_KERNEL is not None
        and query.device.type in VARLEN_DEVICES
        and query.dtype in (torch.float16, torch.bfloat16)
        and sinks is None
        and query.shape[-1] >= value.shape[-1]
        and (window is None or "window_size" in _VARLEN_PARAMS)
    )


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
        split = zip(*(torch.split(t, 1) for t in (query, key, value)), strict=True)
        rows = [_row(q, k, v, scaling, sliding_window, s_aux) for q, k, v in split]
        return torch.stack(rows), None
    if varlen_takes(query, value, sliding_window, s_aux):
        return _varlen(query, key, value, layout, scaling, sliding_window), None
    # The rows' spans and the gaps between them as ONE split of each tensor: its backward is
    # one concatenation, where a slice per row would build a zero-filled [1, H, S, D] gradient
    # per row and add them up (rows x sequence work in every layer).
    sizes, real, at = [], [], 0
    for start, length in layout.spans():
        if start > at:
            sizes.append(start - at)
            real.append(False)
        sizes.append(length)
        real.append(True)
        at = start + length
    if at < seq:
        sizes.append(seq - at)
        real.append(False)
    split = zip(*(torch.split(t, sizes, dim=2) for t in (query, key, value)), strict=True)
    parts = [
        _row(q, k, v, scaling, sliding_window, s_aux) if row else query.new_zeros(n, heads, dim_v)
        for row, n, (q, k, v) in zip(real, sizes, split, strict=True)
    ]
    return torch.cat(parts).unsqueeze(0), None


def _varlen(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layout: packing.Packing,
    scaling: float | None,
    window: int | None,
) -> torch.Tensor:
    """Every row of the packed [1, H, S, D] sequence in one varlen call -> [1, S, H, Dv]. A row's
    sequence is its block (`layout.widths`): real tokens first, so causal attention keeps its
    padding out of them; padding positions get values nothing real reads. A narrower value
    head (MLA) is zero-padded to the q/k head for the call (the kernel takes one head dim)."""
    assert _VARLEN_KERNEL is not None
    heads, dim_v = query.shape[1], value.shape[-1]
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))  # [S, H, D]
    if dim_v < q.shape[-1]:
        v = F.pad(v, (0, q.shape[-1] - dim_v))
    if k.shape[1] != heads and "enable_gqa" not in _VARLEN_PARAMS:
        k, v = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (k, v))
    cu = _cumulative(layout.widths, query.device)
    longest = max(layout.widths)
    kwargs: dict[str, Any] = {"scale": scaling}
    if "window_size" in _VARLEN_PARAMS:
        kwargs["window_size"] = (-1 if window is None else window - 1, 0)
    else:
        kwargs["is_causal"] = True
    if "enable_gqa" in _VARLEN_PARAMS:
        kwargs["enable_gqa"] = k.shape[1] != heads
    out = _VARLEN_KERNEL(q, k, v, cu, cu, longest, longest, **kwargs)
    return out[..., :dim_v].unsqueeze(0)


@functools.lru_cache(maxsize=64)
def _cumulative(widths: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """int32 sequence boundaries [0, w0, w0 + w1, ...] on `device` (one copy per layout)."""
    return torch.tensor([0, *itertools.accumulate(widths)], dtype=torch.int32, device=device)


AttentionInterface.register(ROW_ATTENTION, row_attention_forward)
