"""The hybrid kernels in PyTorch: the reference every field kernel is checked against, and what
runs where no field kernel does (a CPU, float32 weights, a kernel that is missing or failed its
self-check: `hybrid_kernels`).

Each is transformers' own algorithm (`modeling_qwen3_5.causal_conv1d_fn` and
`torch_chunk_gated_delta_rule`, `modeling_nemotron_h.mamba2_chunk_scan`, as of 5.24) run on every
row of a packed micro-batch at once, laid out so that it holds no more than transformers' run on
each row alone (which pads every row to whole chunks itself):
- the convolution: each row after width - 1 zeros, one convolution over the whole sequence;
- the chunked scans: each row from a chunk boundary, padded to whole chunks, the chunks of all
  rows in one sequence; chunk-local work is shared, and the state carried from chunk to chunk
  starts again from zero at each row's first chunk.
Padding only ever follows a row's positions, and every kernel is causal, so a row's numbers are
those of the row alone.

Inputs and outputs are packed and token-major, [1, T, ...], as the layers hold them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from lockstep.modeling.packing import Packing

DELTA_RULE_CHUNK = 64  # transformers' chunk length for the gated delta rule


def _spread(x: torch.Tensor, index: torch.Tensor, length: int) -> torch.Tensor:
    """[1, T, ...] -> [1, length, ...]: position t at index[t], zeros elsewhere."""
    out = x.new_zeros((length, *x.shape[2:])).index_copy(0, index, x[0])
    return out.unsqueeze(0)


def _gather(y: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The inverse of `_spread`: [1, length, ...] -> [1, T, ...]."""
    return y[0].index_select(0, index).unsqueeze(0)


def _row_offsets(rows: Packing, size: int) -> list[int]:
    """Where each row starts when every row takes whole `size`-position units."""
    units = [-(-w // size) * size for w in rows.widths]
    return [sum(units[:i]) for i in range(len(units) + 1)]


def _chunk_index(rows: Packing, chunk: int, device: torch.device) -> torch.Tensor:
    """Each packed position's slot when every row starts a chunk (the chunk-aligned layout)."""

    def build(rows: Packing) -> Sequence[int]:
        offsets = _row_offsets(rows, chunk)
        return [offsets[i] + j for i, w in enumerate(rows.widths) for j in range(w)]

    return rows.index(f"chunks-{chunk}", device, build)


def _last_chunks(rows: Packing, chunk: int) -> list[int]:
    """The index of each row's last chunk in the chunk-aligned layout."""
    return [o // chunk - 1 for o in _row_offsets(rows, chunk)[1:]]


def short_convolution(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str | None,
    rows: Packing,
) -> torch.Tensor:
    """Causal depthwise convolution of each row ([1, T, D], weight [D, W]), state zero at every
    row's start, then the activation: `causal_conv1d_fn`."""
    pad = weight.shape[-1] - 1

    def slots(after: int) -> Callable[[Packing], Sequence[int]]:  # row i after (i + after) pads
        return lambda rows: [
            s + j + (i + after) * pad for i, (s, w) in enumerate(rows.blocks()) for j in range(w)
        ]

    index = rows.index(f"conv-in-{pad}", x.device, slots(1))
    spread = _spread(x, index, x.shape[1] + len(rows.widths) * pad).transpose(1, 2)
    out = F.conv1d(spread.to(weight.dtype), weight.unsqueeze(1), bias, groups=spread.shape[1])
    if activation is not None:
        out = ACT2FN[activation](out)
    # Output i is the window ending at input i + pad.
    return _gather(
        out.to(x.dtype).transpose(1, 2), rows.index(f"conv-out-{pad}", x.device, slots(0))
    )


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    rows: Packing,
) -> torch.Tensor:
    """Gated DeltaNet's recurrence per row, q/k L2-normalised, q scaled by 1/sqrt(d_k):
    q, k [1, T, Hk, dk]; v [1, T, Hv, dv] (value head h reads key head h // (Hv / Hk));
    g (log decay, <= 0) and beta [1, T, Hv]. Returns [1, T, Hv, dv] in q's dtype."""
    chunk = DELTA_RULE_CHUNK
    index = _chunk_index(rows, chunk, q.device)
    length = _row_offsets(rows, chunk)[-1]
    qs, ks, vs, gs, betas = (_spread(t, index, length) for t in (q, k, v, g, beta))
    firsts = {i + 1 for i in _last_chunks(rows, chunk)}
    return _gather(_chunk_gated_delta_rule(qs, ks, vs, gs, betas, firsts), index)


def _chunk_gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    firsts: set[int],
) -> torch.Tensor:
    """transformers' `torch_chunk_gated_delta_rule` (no initial or final state), the state
    starting from zero again at each chunk in `firsts`; the length is whole chunks."""
    chunk = DELTA_RULE_CHUNK
    dtype = query.dtype
    batch, length, k_heads, _ = key.shape
    v_heads, v_dim = value.shape[-2:]
    if k_heads != v_heads:
        query = query.repeat_interleave(v_heads // k_heads, dim=2)
        key = key.repeat_interleave(v_heads // k_heads, dim=2)
    query, key, value, beta, g = (
        x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
        for x in (query, key, value, beta, g)
    )
    query, key = _l2norm(query), _l2norm(key)
    query = query * query.shape[-1] ** -0.5
    v_beta = value * beta.unsqueeze(-1)
    k_beta = key * beta.unsqueeze(-1)
    query, key, k_beta, v_beta = (
        x.reshape(x.shape[0], x.shape[1], -1, chunk, x.shape[-1])
        for x in (query, key, k_beta, v_beta)
    )
    g = g.reshape(g.shape[0], g.shape[1], -1, chunk)
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=query.device).triu(1)
    cum = g.cumsum(dim=3)
    pairwise = (cum.unsqueeze(4) - cum.unsqueeze(3)).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ key.transpose(-1, -2)) * pairwise
    intra = (query @ key.transpose(-1, -2)) * pairwise
    decayed_k_beta = k_beta * cum.exp().unsqueeze(-1)
    new_values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(
        system, decayed_k_beta, upper=False, unitriangular=True
    )
    zero = new_values.new_zeros(batch, v_heads, key.shape[-1], v_dim)
    state = zero
    out = torch.zeros_like(new_values)
    query = query * cum.exp().unsqueeze(-1)
    key = key * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()[..., None, None]
    for i in range(length // chunk):
        if i in firsts:
            state = zero
        v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ state
        out[:, :, i] = query[:, :, i] @ state + intra[:, :, i] @ v_new
        state = state * chunk_decay[:, :, i] + key[:, :, i].transpose(-1, -2) @ v_new
    out = out.reshape(batch, v_heads, -1, v_dim)
    return out.transpose(1, 2).to(dtype, memory_format=torch.contiguous_format)


def mamba2_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    d: torch.Tensor,
    dt_bias: torch.Tensor,
    dt_limit: tuple[float, float],
    chunk: int,
    rows: Packing,
) -> torch.Tensor:
    """Mamba-2's selective scan per row: dt = clamp(softplus(dt + dt_bias)), state
    h_t = exp(a dt_t) h_{t-1} + dt_t x_t B_t^T, y_t = C_t h_t + d x_t. x [1, T, H, P],
    dt [1, T, H], a / d / dt_bias [H], B / C [1, T, G, S] (head h reads group h // (H / G)).
    Returns [1, T, H, P] in float32 (transformers' scan output dtype)."""
    dt = dt + dt_bias.to(dt.dtype)
    dt = F.softplus(dt).clamp(min=dt_limit[0], max=dt_limit[1])
    index = _chunk_index(rows, chunk, x.device)
    length = _row_offsets(rows, chunk)[-1]
    xs, dts, bs, cs = (_spread(t, index, length) for t in (x, dt, b, c))
    ends = rows.index(f"last-chunks-{chunk}", x.device, lambda r: _last_chunks(r, chunk))
    lasts = torch.zeros(length // chunk, dtype=torch.bool, device=x.device).index_fill(
        0, ends, True
    )
    out = _chunk_scan(xs, dts, bs, cs, a, d, chunk, lasts)
    return _gather(out, index)


def _segment_sum(x: torch.Tensor) -> torch.Tensor:
    """transformers' `segment_sum`: [..., L] -> [..., L, L] sums of x over (j, i], -inf above."""
    size = x.size(-1)
    x = x[..., None].expand(*x.size(), size)
    below = torch.tril(torch.ones(size, size, device=x.device, dtype=torch.bool), diagonal=-1)
    sums = torch.cumsum(x.masked_fill(~below, 0), dim=-2)
    keep = torch.tril(torch.ones(size, size, device=x.device, dtype=torch.bool), diagonal=0)
    return sums.masked_fill(~keep, -torch.inf)


def _chunk_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    a: torch.Tensor,
    d: torch.Tensor,
    chunk: int,
    lasts: torch.Tensor,
) -> torch.Tensor:
    """transformers' `mamba2_chunk_scan` (no initial or final state; dt already discretised;
    the length whole chunks), no state carried out of a chunk in `lasts` (a row's last)."""
    batch, length, heads, head_dim = x.shape
    groups = b.shape[2]
    x = x.float()
    b = b.float().repeat_interleave(heads // groups, dim=2, output_size=heads)
    c = c.float().repeat_interleave(heads // groups, dim=2, output_size=heads)
    residual = d[..., None] * x
    x = x * dt[..., None].float()
    a_dt = a.to(x.dtype) * dt.float()
    x, a_dt, b, c = (t.reshape(batch, -1, chunk, *t.shape[2:]) for t in (x, a_dt, b, c))
    a_dt = a_dt.permute(0, 3, 1, 2)
    a_cum = torch.cumsum(a_dt, dim=-1)
    decay = torch.exp(_segment_sum(a_dt))
    scores = torch.einsum("bclhn,bcshn->bclsh", c, b) * decay.permute(0, 2, 3, 4, 1)
    y_diag = torch.einsum("bclsh,bcshp->bclhp", scores, x)
    b_decay = b * torch.exp(a_cum[:, :, :, -1:] - a_cum).permute(0, -2, -1, 1)[..., None]
    states = torch.einsum("bclhn,bclhp->bchpn", b_decay, x)
    # A row's last chunk hands no state on, and no decay passes it: rows stay apart.
    states = states.masked_fill(lasts[None, :, None, None, None], 0.0)
    ends = a_cum[:, :, :, -1].masked_fill(lasts, -torch.inf)
    states = torch.cat([torch.zeros_like(states[:, :1]), states], dim=1)
    chunk_decay = torch.exp(_segment_sum(F.pad(ends, (1, 0)))).transpose(1, 3)
    states = torch.einsum("bzch,bzhpn->bchpn", chunk_decay, states)[:, :-1]
    c_states = torch.einsum("bclhn,bchpn->bclhp", c, states)
    y_off = c_states * torch.exp(a_cum).permute(0, 2, 3, 1)[..., None]
    out = (y_diag + y_off).contiguous().reshape(batch, -1, heads, head_dim) + residual
    return out
