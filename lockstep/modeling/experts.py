"""Mixture-of-experts layers with a LoRA on every expert, for many tenants at once.

transformers 5 keeps a MoE layer's experts as fused 3-D parameters (`gate_up_proj`,
`down_proj`, optional biases) in a module whose layout flags come from
`use_experts_implementation` (`is_transposed`, `is_concatenated` gate|up or interleaved,
`has_bias`) and whose activation is `_apply_gate` (SwiGLU; gpt-oss: clamped, `(up + 1)` gated).
`MultiLoRAExperts` replaces such a module, keeping its parameters under the same names, and
computes the same function plus each tenant's LoRA on each expert's gate (w1), up (w3) and down
(w2) projections, the way Tinker trains MoE models (its adapter files keep them as 3-D tensors
`experts.w1.lora_A.weight` [experts, rank, in] / `lora_B.weight` [experts, out, rank]).

Work is grouped, never gathered per token: the (token, expert) pairs of a call are sorted by
expert and, within an expert, by adapter; each expert runs one base GEMM over all its pairs and
each (expert, adapter) group one LoRA GEMM pair over its own pairs. Routing stays dropless and
every pair's result depends only on its token, so a tenant alone and packed get the same numbers
(to float rounding). The router stays frozen (it is not an expert).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lockstep.modeling.routing import RoutingSlot

# Tinker's names for the three expert projections.
GATE, UP, DOWN = "w1", "w3", "w2"
# (projection, adapter) -> that adapter's A and B of the projection, split per expert.
Views = dict[tuple[str, str], tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]]


class ExpertSlot:
    """The adapters' LoRA of one projection of every expert: A [E, r, in], B [E, out, r]."""

    def __init__(self, owner: MultiLoRAExperts, experts: int, fan_in: int, fan_out: int) -> None:
        self._owner = owner
        self.experts = experts
        self.in_features = fan_in
        self.out_features = fan_out
        self.lora_A: dict[str, nn.Parameter] = {}
        self.lora_B: dict[str, nn.Parameter] = {}
        self.scale: dict[str, float] = {}

    @property
    def device(self) -> torch.device:
        return self._owner.down_proj.device


def is_fused_experts(module: nn.Module) -> bool:
    """A transformers 5 experts module of a layout `MultiLoRAExperts` computes."""
    down = getattr(module, "down_proj", None)
    return (
        isinstance(down, nn.Parameter)
        and down.dim() == 3
        and getattr(module, "has_gate", False) is True
        and isinstance(getattr(module, "gate_up_proj", None), nn.Parameter)
        and getattr(module, "has_post_expert_norm", True) is False
        and isinstance(getattr(module, "is_transposed", None), bool)
        and isinstance(getattr(module, "is_concatenated", None), bool)
    )


class MultiLoRAExperts(nn.Module):
    gate_up_proj: nn.Parameter
    down_proj: nn.Parameter
    gate_up_proj_bias: nn.Parameter | None
    down_proj_bias: nn.Parameter | None

    def __init__(self, base: nn.Module, slot: RoutingSlot) -> None:
        super().__init__()
        assert is_fused_experts(base)
        # The same Parameter objects under the same names: state-dict keys do not change.
        src: Any = base  # attributes set by transformers' `use_experts_implementation`
        self.gate_up_proj = src.gate_up_proj
        self.down_proj = src.down_proj
        self.gate_up_proj_bias = src.gate_up_proj_bias if src.has_bias else None
        self.down_proj_bias = src.down_proj_bias if src.has_bias else None
        self.is_transposed = bool(src.is_transposed)
        self.is_concatenated = bool(src.is_concatenated)
        self._apply_gate: Callable[[torch.Tensor], torch.Tensor] = src._apply_gate
        self.num_experts = int(self.down_proj.shape[0])
        hidden, inter = self._dims()
        self._slot = slot
        self.slots = {
            GATE: ExpertSlot(self, self.num_experts, hidden, inter),
            UP: ExpertSlot(self, self.num_experts, hidden, inter),
            DOWN: ExpertSlot(self, self.num_experts, inter, hidden),
        }

    def _dims(self) -> tuple[int, int]:
        """(hidden, intermediate) from the down projection's shape."""
        _, a, b = self.down_proj.shape  # [E, H, I], or [E, I, H] transposed
        return (b, a) if self.is_transposed else (a, b)

    def _linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        y = x.to(weight.dtype) @ (weight if self.is_transposed else weight.t())
        return y if bias is None else y + bias

    def _fuse(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """[m, I] gate and up parts -> [m, 2I] in the layout of gate_up_proj's output."""
        if self.is_concatenated:
            return torch.cat([gate, up], dim=-1)
        return torch.stack([gate, up], dim=-1).flatten(-2)  # [g0, u0, g1, u1, ...]

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        tokens, k = top_k_index.shape
        routing = self._slot.current
        names, ordinal = (
            ([], None) if routing is None else routing.token_adapters(tokens, hidden_states.device)
        )
        adapters = len(names)
        expert = top_k_index.reshape(-1)
        token = torch.arange(tokens, device=expert.device).repeat_interleave(k)
        adapter = torch.full_like(expert, -1) if ordinal is None else ordinal.index_select(0, token)
        order = torch.argsort(expert * (adapters + 1) + adapter + 1, stable=True)
        keys, counts = torch.unique_consecutive(
            (expert * (adapters + 1) + adapter + 1).index_select(0, order), return_counts=True
        )
        weight = top_k_weights.reshape(-1).index_select(0, order)
        token = token.index_select(0, order)
        out = torch.zeros_like(hidden_states)
        views: Views = {}
        groups = list(zip(keys.tolist(), counts.tolist(), strict=True))
        at, g = 0, 0
        while g < len(groups):
            e = groups[g][0] // (adapters + 1)
            members = []  # (adapter ordinal or -1, start, stop) within this expert's pairs
            start = at
            while g < len(groups) and groups[g][0] // (adapters + 1) == e:
                key, count = groups[g]
                members.append((key % (adapters + 1) - 1, at - start, at - start + count))
                at, g = at + count, g + 1
            rows = slice(start, at)
            y = self._expert(e, hidden_states.index_select(0, token[rows]), members, names, views)
            y = y * weight[rows].unsqueeze(-1).to(y.dtype)
            out = out.index_add(0, token[rows], y.to(out.dtype))
        return out

    def _expert(
        self,
        e: int,
        x: torch.Tensor,
        members: list[tuple[int, int, int]],
        names: list[str],
        views: Views,
    ) -> torch.Tensor:
        """Expert e on its pairs x [m, H] (grouped by adapter as `members`) -> [m, H]."""
        gu_bias = None if self.gate_up_proj_bias is None else self.gate_up_proj_bias[e]
        gate_up = self._linear(x, self.gate_up_proj[e], gu_bias)
        gate = self._lora(GATE, e, x, members, names, views)
        up = self._lora(UP, e, x, members, names, views)
        if gate is not None or up is not None:
            zeros = x.new_zeros(x.shape[0], self.slots[GATE].out_features, dtype=torch.float32)
            gate_up = gate_up + self._fuse(
                zeros if gate is None else gate, zeros if up is None else up
            ).to(gate_up.dtype)
        h = self._apply_gate(gate_up)
        d_bias = None if self.down_proj_bias is None else self.down_proj_bias[e]
        y = self._linear(h, self.down_proj[e], d_bias)
        down = self._lora(DOWN, e, h, members, names, views)
        return y if down is None else y + down.to(y.dtype)

    def _lora(
        self,
        which: str,
        e: int,
        x: torch.Tensor,
        members: list[tuple[int, int, int]],
        names: list[str],
        views: Views,
    ) -> torch.Tensor | None:
        """The LoRA delta of projection `which` of expert e for rows x [m, in] (zeros for rows
        whose adapter does not train it); None when no row's adapter does. `views` holds each
        adapter's per-expert tensors of this call (see `_unbind`)."""
        slot = self.slots[which]
        parts, any_lora = [], False
        for ordinal, start, stop in members:
            name = names[ordinal] if ordinal >= 0 else None
            if name is None or name not in slot.lora_A:
                parts.append(x.new_zeros(stop - start, slot.out_features, dtype=torch.float32))
                continue
            if (which, name) not in views:
                views[which, name] = _unbind(slot, name)
            a_e, b_e = views[which, name]
            a, b = a_e[e], b_e[e]
            h = x[start:stop].to(a.dtype) @ a.t()
            parts.append((h * slot.scale[name]) @ b.t())
            any_lora = True
        return torch.cat(parts) if any_lora else None


def _unbind(
    slot: ExpertSlot, name: str
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """An adapter's A and B split per expert ONCE per call: the backward of one `unbind` writes
    the whole [E, ...] gradient once, where indexing `param[e]` per expert allocates and adds a
    full-size zero gradient for every expert (E times the work, per tenant)."""
    return slot.lora_A[name].unbind(0), slot.lora_B[name].unbind(0)
