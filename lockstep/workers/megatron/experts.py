"""Multi-tenant LoRA on megatron MoE layers (Qwen3-MoE), experts split over EP ranks.

`LoraMoE` runs a megatron MoELayer's own stages (router, permute, all-to-all dispatch, experts,
all-to-all combine, unpermute) and adds each tenant's LoRA on every expert's gate (w1), up (w3)
and down (w2), as the local engine's `MultiLoRAExperts`: per adapter and projection, A
[E_local, r, in] / B [E_local, out, r], this EP rank's slice of Tinker's 3-D adapter tensors
(they merge over EP ranks along dim 0). Experts compute as the local engine's: fc2 and its LoRA
on silu(gate) * up, then times the token's routing weight.

- A dispatched token's adapter: its ordinal (index in the sorted adapter ids, the same on every
  rank) is an integer tensor, never a value of the hidden dtype (bf16 holds integers exactly
  only up to 256): its bits ride along as one extra column of the hidden states through
  megatron's own permute, all-to-all and sort (which copy, never compute), and are read back as
  the same integers before the expert GEMMs (`_tag`, `_untag`).
- TP ranks hold the same tokens: with TP > 1 each routes only its 1/TP share (as megatron's
  sequence parallel would) and the outputs are all-gathered, so every token's experts run once
  and expert grads add up over the expert-data-parallel group.
- Every MoE input adds an exact zero that requires grad: each layer's backward all-to-alls then
  run on every EP rank, also on one whose rows train nothing there (they pair up across ranks).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from lockstep.modeling.experts import DOWN, GATE, UP

Tensor = torch.Tensor


class TokenRouting(Protocol):
    """What the LoRA wrappers share: the adapter id of each batch row, and every adapter id."""

    rows: list[str | None]
    names: list[str]


class ExpertLora:
    """Every adapter's LoRA on one projection of this rank's experts."""

    def __init__(self, path: str, fan_in: int, fan_out: int) -> None:
        self.path = path  # HF path of the 3-D adapter, e.g. "model.layers.0.mlp.experts.w1"
        self.fan_in, self.fan_out = fan_in, fan_out
        self.lora_A: dict[str, nn.Parameter] = {}  # [E_local, r, in]
        self.lora_B: dict[str, nn.Parameter] = {}  # [E_local, out, r]
        self.scale: dict[str, float] = {}

    def delta(self, e: int, x: Tensor, ordinal: Tensor, names: list[str]) -> Tensor | None:
        """LoRA of local expert e on its rows x [m, in] (adapter `ordinal` per row; -1: none)."""
        out = None
        for o in torch.unique(ordinal).tolist():
            name = names[o] if o >= 0 else None
            if name is None or name not in self.lora_A:
                continue
            rows = (ordinal == o).nonzero().squeeze(1)
            a, b = self.lora_A[name][e], self.lora_B[name][e]
            d = (x.index_select(0, rows) @ a.t() * self.scale[name]) @ b.t()
            base = x.new_zeros(x.shape[0], self.fan_out) if out is None else out
            out = base.index_add(0, rows, d)
        return out


class LoraMoE(nn.Module):
    def __init__(
        self,
        moe: nn.Module,
        routing: TokenRouting,
        path: str,
        hidden: int,
        intermediate: int,
        tp: int,
        tp_rank: int,
    ) -> None:
        super().__init__()
        self.moe = moe
        self._routing = routing
        self.hidden = hidden
        self.tp, self.tp_rank = tp, tp_rank
        self.slots = {
            GATE: ExpertLora(f"{path}.{GATE}", hidden, intermediate),
            UP: ExpertLora(f"{path}.{UP}", hidden, intermediate),
            DOWN: ExpertLora(f"{path}.{DOWN}", intermediate, hidden),
        }
        device = next(moe.parameters()).device
        self._anchor = torch.zeros((), device=device, requires_grad=True)

    def forward(self, hidden: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, None]:
        from megatron.core.tensor_parallel import (
            gather_from_sequence_parallel_region,
            scatter_to_sequence_parallel_region,
        )

        s, b, h = hidden.shape
        routing = self._routing
        index = {name: i for i, name in enumerate(routing.names)}
        per_row = torch.tensor([-1 if a is None else index[a] for a in routing.rows])
        ordinal = per_row.to(hidden.device).repeat(s)  # token t = (seq t // b, row t % b)
        x = hidden.reshape(s * b, h)
        if torch.is_grad_enabled():
            x = x + self._anchor
        pad = (-x.shape[0]) % self.tp
        if self.tp > 1:
            if pad:
                x = torch.cat([x, x.new_zeros(pad, h)])
                ordinal = torch.cat([ordinal, ordinal.new_full((pad,), -1)])
            x = scatter_to_sequence_parallel_region(x)
            ordinal = torch.chunk(ordinal, self.tp)[self.tp_rank]
        out = self._moe(x, ordinal)
        if self.tp > 1:
            # Every TP rank computes the same loss from here on: the backward takes this rank's
            # share of the gradient, it does not sum the (equal) copies.
            out = gather_from_sequence_parallel_region(out, tensor_parallel_output_grad=False)
            out = out[: s * b]
        return out.reshape(s, b, h), None

    def _moe(self, x: Tensor, ordinal: Tensor) -> Tensor:
        moe: Any = self.moe
        dispatcher = moe.token_dispatcher
        probs, routing_map = moe.route(x)
        tagged = torch.cat([x, _tag(ordinal, x.dtype).unsqueeze(1)], dim=1)  # [tokens, h + 1]
        tokens, probs = moe.preprocess(tagged, probs, routing_map)
        tokens, probs = moe.dispatch(tokens, probs)
        tokens, per_expert, probs = dispatcher.dispatch_postprocess(tokens, probs)
        y = self._experts(tokens, per_expert.tolist(), probs)
        y = torch.cat([y, y.new_zeros(y.shape[0], 1)], dim=1)  # the dispatcher's width
        out: Tensor = moe.combine(dispatcher.combine_preprocess(y))
        out = moe.postprocess(out, None)
        return out[:, : self.hidden].contiguous()  # a stage output goes out over p2p as is

    def _experts(self, tokens: Tensor, counts: list[int], probs: Tensor) -> Tensor:
        """Each local expert on its (token, ordinal) rows, sorted by expert -> [n, hidden]."""
        names = self._routing.names
        outs = []
        moe: Any = self.moe
        experts = moe.experts.local_experts
        for e, (rows, p) in enumerate(
            zip(torch.split(tokens, counts), torch.split(probs, counts), strict=True)
        ):
            expert = experts[e]
            x, ordinal = rows[:, : self.hidden], _untag(rows[:, self.hidden])
            fc1, _ = expert.linear_fc1(x)
            gate, up = torch.chunk(fc1, 2, dim=-1)
            d_gate = self.slots[GATE].delta(e, x, ordinal, names)
            d_up = self.slots[UP].delta(e, x, ordinal, names)
            gate = gate if d_gate is None else gate + d_gate
            up = up if d_up is None else up + d_up
            act = F.silu(gate) * up
            y, _ = expert.linear_fc2(act)
            d_down = self.slots[DOWN].delta(e, act, ordinal, names)
            y = y if d_down is None else y + d_down
            outs.append(y * p.unsqueeze(-1).to(y.dtype))
        return torch.cat(outs) if outs else tokens.new_zeros(0, self.hidden)


# The integer type whose bits fill one value of each hidden dtype.
_BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def _tag(ordinal: Tensor, dtype: torch.dtype) -> Tensor:
    """Integer ordinals (-1: no adapter) as the bits of `dtype` values. Shifted by one, they are
    zero or tiny positive numbers, never NaN or inf, whatever the copies do with those."""
    return (ordinal + 1).to(_BITS[dtype]).view(dtype)


def _untag(column: Tensor) -> Tensor:
    """The integer ordinals whose bits `_tag` put in a column of hidden values."""
    return column.contiguous().view(_BITS[column.dtype]).long() - 1
