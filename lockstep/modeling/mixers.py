"""Stateful sequence mixers (Gated DeltaNet linear attention, Mamba-2) over a packed micro-batch.

A recurrent layer carries a state and a short causal convolution along the sequence; run over a
packed micro-batch as one sequence, row i would start from row i - 1's state. Every row's state
and convolution must start from zero, as for the row alone.

PACKED (default): the layer's forward written from the module's own parameters and submodules
(its projections, with their LoRA; its gated norm; its out_proj) runs every row of the
micro-batch at once, each kernel called once per layer on the whole sequence with the rows'
bounds (`hybrid_kernels`: the field's varlen kernels on a GPU, the reference vectorised over rows
elsewhere). transformers' own layer cannot take packed rows cleanly: its convolution without the
`causal-conv1d` package (source only) would mix rows, and which kernels it calls is fixed by what
is installed when it is imported, unchecked. The layer forwards follow transformers' (5.17 ..
5.24): Qwen3.5 / Qwen3.5-MoE and Qwen3-Next's Gated DeltaNet differ only in their input
projections; Mamba-2 is Nemotron-H's mixer. tests/unit/test_hybrid_kernels.py holds them equal to
transformers' forward of each row alone, logprobs and every adapter gradient.

PER ROW (`PACKED = False`, what ran before; the benchmarks compare): transformers' own forward
once per row block, with the LoRA routing narrowed to that block, the results concatenated.

A block is the row's real tokens followed by its alignment padding: the mixers are causal, so
the trailing padding never reaches a real token. Outside a packing (the sampler, the generic
path) the module runs as transformers wrote it.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lockstep.modeling import packing
from lockstep.modeling.decoder_layers import number
from lockstep.modeling.hybrid_kernels import Kernels, Shapes

Narrow = Callable[[int, int], AbstractContextManager[None]]

PACKED = True  # False: transformers' own forward once per row (benchmarks compare the two)


def install(module: nn.Module, kernels: Kernels, narrow: Narrow) -> None:
    """Wrap `module.forward` (hidden_states first, [B, T, H] -> [B, T, H]) to keep packed rows
    apart: the packed forward, or per row (`PACKED`).

    narrow(start, stop): a context routing positions start..stop-1 of the packed sequence as the
    whole input (the LoRA layers inside the module see only that block).
    """
    inner: Callable[..., torch.Tensor] = module.forward
    packed = _gated_deltanet if hasattr(module, "head_k_dim") else _mamba2

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
        if PACKED:
            mask = kwargs.get("attention_mask")
            if mask is not None and not bool(mask.all()):
                raise ValueError("a packed micro-batch has no padding mask")
            cached = [kwargs.get("cache"), kwargs.get("cache_params"), *rest]
            if any(c is not None for c in cached):
                raise ValueError("a packed micro-batch runs without a cache")
            return packed(module, hidden, layout, kernels)
        return _per_row(inner, hidden, rest, kwargs, layout, narrow)

    module.forward = forward


def _per_row(
    inner: Callable[..., torch.Tensor],
    hidden: torch.Tensor,
    rest: tuple[Any, ...],
    kwargs: dict[str, Any],
    layout: packing.Packing,
    narrow: Narrow,
) -> torch.Tensor:
    blocks = layout.blocks()
    # One split (its backward one concatenation), not a slice per block (each slice's backward
    # a zero-filled gradient of the whole sequence).
    pieces = torch.split(hidden, [width for _, width in blocks], dim=1)
    outs = []
    for (start, width), piece in zip(blocks, pieces, strict=True):
        with narrow(start, start + width):
            outs.append(inner(piece, *rest, **kwargs))
    return torch.cat(outs, dim=1)


def shapes(modules: list[nn.Module]) -> Shapes:
    """The kernel shapes of a model's recurrent mixers (the first of each kind)."""
    conv: tuple[int, int, bool, str | None] | None = None
    delta = mamba = None
    for m in modules:
        conv1d = m.conv1d
        assert isinstance(conv1d, nn.Conv1d)
        channels, _, width = conv1d.weight.shape
        activation = getattr(m, "activation", None)
        conv = conv or (channels, width, conv1d.bias is not None, activation)
        if hasattr(m, "head_k_dim"):
            heads = (number(m, "num_k_heads"), number(m, "head_k_dim"))
            delta = delta or (*heads, number(m, "num_v_heads"), number(m, "head_v_dim"))
        else:
            groups = (number(m, "n_groups"), number(m, "ssm_state_size"))
            mamba = mamba or (number(m, "num_heads"), number(m, "head_dim"), *groups)
    return Shapes(conv=conv, delta=delta, mamba=mamba)


# -- Gated DeltaNet (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) -------------------------------------


def _deltanet_inputs(
    m: Any, hidden: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The layer's input projections: the convolution's channels [1, T, 2 Dk + Dv] (q | k | v),
    the output gate z [1, T, Hv, dv], beta's and the decay's logits b, a [1, T, Hv]."""
    t = hidden.shape[1]
    if hasattr(m, "in_proj_qkvz"):  # Qwen3-Next: fused per key head, transformers' reordering
        q, k, v, z, b, a = m.fix_query_key_value_ordering(
            m.in_proj_qkvz(hidden), m.in_proj_ba(hidden)
        )
        mixed = torch.cat([x.reshape(1, t, -1) for x in (q, k, v)], dim=-1)
        return mixed, z, b, a
    z = m.in_proj_z(hidden).reshape(1, t, -1, m.head_v_dim)
    return m.in_proj_qkv(hidden), z, m.in_proj_b(hidden), m.in_proj_a(hidden)


def _gated_deltanet(
    m: Any, hidden: torch.Tensor, rows: packing.Packing, kernels: Kernels
) -> torch.Tensor:
    t = hidden.shape[1]
    mixed, z, b, a = _deltanet_inputs(m, hidden)
    weight = m.conv1d.weight.squeeze(1)
    mixed = kernels.short_convolution(mixed, weight, m.conv1d.bias, m.activation, rows)
    q, k, v = torch.split(mixed, [m.key_dim, m.key_dim, m.value_dim], dim=-1)
    q = q.reshape(1, t, -1, m.head_k_dim)
    k = k.reshape(1, t, -1, m.head_k_dim)
    v = v.reshape(1, t, -1, m.head_v_dim)
    beta = b.sigmoid()
    g = -m.A_log.float().exp() * F.softplus(a.float() + m.dt_bias)  # float32, as transformers
    out = kernels.gated_delta_rule(q, k, v, g, beta, rows)
    out = m.norm(out.reshape(-1, m.head_v_dim), z.reshape(-1, m.head_v_dim))
    result: torch.Tensor = m.out_proj(out.reshape(1, t, -1))
    return result


# -- Mamba-2 (Nemotron-H) ------------------------------------------------------------------


def _mamba2(m: Any, hidden: torch.Tensor, rows: packing.Packing, kernels: Kernels) -> torch.Tensor:
    t, dtype = hidden.shape[1], hidden.dtype
    projected = m.in_proj(hidden)
    a = -torch.exp(m.A_log.float())
    gate, xbc, dt = projected.split([m.intermediate_size, m.conv_dim, m.num_heads], dim=-1)
    weight = m.conv1d.weight.squeeze(1)
    xbc = kernels.short_convolution(xbc, weight, m.conv1d.bias, m.activation, rows)
    state = m.n_groups * m.ssm_state_size
    x, b, c = torch.split(xbc, [m.intermediate_size, state, state], dim=-1)
    y = kernels.mamba2_scan(
        x.reshape(1, t, m.num_heads, m.head_dim),
        dt,
        a,
        b.reshape(1, t, m.n_groups, m.ssm_state_size),
        c.reshape(1, t, m.n_groups, m.ssm_state_size),
        m.D,
        m.dt_bias,
        m.time_step_limit,
        m.chunk_size,
        rows,
    )
    y = m.norm(y.reshape(1, t, -1), gate)
    result: torch.Tensor = m.out_proj(y.to(dtype))
    return result
