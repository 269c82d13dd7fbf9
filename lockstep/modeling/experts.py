"""Mixture-of-experts layers with a LoRA on every expert, for many tenants at once.

transformers 5 keeps a MoE layer's experts as fused 3-D parameters in a module whose layout
flags come from `use_experts_implementation` (`is_transposed`, `is_concatenated` gate|up or
interleaved, `has_bias`, `has_gate`). Two layouts are computed:
- gated: `gate_up_proj` + `down_proj`, activation `_apply_gate` (SwiGLU; gpt-oss: clamped,
  `(up + 1)` gated). LoRA on each expert's gate (w1), up (w3) and down (w2) projections, the way
  Tinker trains MoE models (its adapter files keep them as 3-D tensors
  `experts.w1.lora_A.weight` [experts, rank, in] / `lora_B.weight` [experts, out, rank]).
- gate-less: `up_proj` + `down_proj`, activation `act_fn` (Nemotron-H: relu^2). Tinker keeps
  w1 = up, w2 = down and an empty w3 placeholder (`PLACEHOLDERS`).
`MultiLoRAExperts` replaces such a module, keeping its parameters under the same names, and
computes the same function plus each tenant's LoRA on each expert's projections.

Work is grouped, never gathered per token: the (token, expert) pairs of a call are sorted by
expert, and each base projection is ONE grouped GEMM over every expert's run of pairs; for the
LoRA the same pairs are regrouped adapter-major (expert order kept), so each adapter's LoRA of a
projection is one grouped GEMM pair over its experts (`torch._grouped_mm`: no host sync and no
per-expert launches on CUDA). Routing stays dropless and every pair's result depends only on
its token, so a tenant alone and packed get the same numbers (to float rounding). The router
stays frozen (it is not an expert).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import nn

from lockstep.modeling.routing import RoutingSlot

# Tinker's names for the three expert projections.
GATE, UP, DOWN = "w1", "w3", "w2"
# Gate-less experts: Tinker's w1 is the up projection, w2 the down one, w3 an empty placeholder.
PLAIN_UP, PLAIN_DOWN = "w1", "w2"
PLACEHOLDERS = {"gated": (), "plain": ("w3",)}
ExpertsLayout = Literal["gated", "plain"]
# Use torch's grouped GEMM kernel where it takes the operands (False: one matmul per group;
# benchmarks/moe_gpu.py compares the two).
GROUPED_KERNEL = True


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


def experts_layout(module: nn.Module) -> ExpertsLayout | None:
    """The layout of a transformers 5 experts module `MultiLoRAExperts` computes, or None."""
    down = getattr(module, "down_proj", None)
    known = (
        isinstance(down, nn.Parameter)
        and down.dim() == 3
        and getattr(module, "has_post_expert_norm", True) is False
        and isinstance(getattr(module, "is_transposed", None), bool)
        and isinstance(getattr(module, "is_concatenated", None), bool)
    )
    if not known:
        return None
    gate = getattr(module, "has_gate", None)
    if gate is True and isinstance(getattr(module, "gate_up_proj", None), nn.Parameter):
        return "gated"
    up = getattr(module, "up_proj", None)
    act = getattr(module, "act_fn", None)
    plain = isinstance(up, nn.Parameter) and up.dim() == 3 and callable(act)
    return "plain" if gate is False and plain else None


class MultiLoRAExperts(nn.Module):
    down_proj: nn.Parameter
    down_proj_bias: nn.Parameter | None

    def __init__(self, base: nn.Module, slot: RoutingSlot) -> None:
        super().__init__()
        layout = experts_layout(base)
        assert layout is not None
        self.layout: ExpertsLayout = layout
        # The same Parameter objects under the same names: state-dict keys do not change.
        src: Any = base  # attributes set by transformers' `use_experts_implementation`
        self._first_name = "gate_up_proj" if layout == "gated" else "up_proj"
        self.register_parameter(self._first_name, getattr(src, self._first_name))
        bias = getattr(src, f"{self._first_name}_bias", None) if src.has_bias else None
        self.register_parameter(f"{self._first_name}_bias", bias)
        self.down_proj = src.down_proj
        self.down_proj_bias = src.down_proj_bias if src.has_bias else None
        self.is_transposed = bool(src.is_transposed)
        self.is_concatenated = bool(src.is_concatenated)
        self._activation: Callable[[torch.Tensor], torch.Tensor] = (
            src._apply_gate if layout == "gated" else src.act_fn
        )
        self.num_experts = int(self.down_proj.shape[0])
        hidden, inter = self._dims()
        self._slot = slot
        if layout == "gated":
            self.slots = {
                GATE: ExpertSlot(self, self.num_experts, hidden, inter),
                UP: ExpertSlot(self, self.num_experts, hidden, inter),
                DOWN: ExpertSlot(self, self.num_experts, inter, hidden),
            }
        else:
            self.slots = {
                PLAIN_UP: ExpertSlot(self, self.num_experts, hidden, inter),
                PLAIN_DOWN: ExpertSlot(self, self.num_experts, inter, hidden),
            }
        self.placeholders: tuple[str, ...] = PLACEHOLDERS[layout]

    def _first(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The first projection's weight (gate_up_proj or up_proj) and bias."""
        return self._parameters[self._first_name], self._parameters[f"{self._first_name}_bias"]  # type: ignore[return-value]

    def _dims(self) -> tuple[int, int]:
        """(hidden, intermediate) from the down projection's shape."""
        _, a, b = self.down_proj.shape  # [E, H, I], or [E, I, H] transposed
        return (b, a) if self.is_transposed else (a, b)

    def _fuse(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """[m, I] gate and up parts -> [m, 2I] in the layout of gate_up_proj's output."""
        if self.is_concatenated:
            return torch.cat([gate, up], dim=-1)
        return torch.stack([gate, up], dim=-1).flatten(-2)  # [g0, u0, g1, u1, ...]

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        tokens, k = top_k_index.shape
        device = hidden_states.device
        routing = self._slot.current
        names, ordinal = ([], None) if routing is None else routing.token_adapters(tokens, device)
        # The (token, expert) pairs, expert-major (stable: by token within an expert).
        expert = top_k_index.reshape(-1)
        order = torch.argsort(expert, stable=True)
        expert = expert.index_select(0, order)
        token = torch.arange(tokens, device=device).repeat_interleave(k).index_select(0, order)
        weight = top_k_weights.reshape(-1).index_select(0, order)
        offsets = group_ends(expert, self.num_experts)
        adapters = _AdapterGroups(names, ordinal, token, expert, self.num_experts)
        x = hidden_states.index_select(0, token).to(self.down_proj.dtype)
        first, first_bias = self._first()
        h = self._base(x, first, first_bias, expert, offsets)
        if self.layout == "gated":
            gate = adapters.delta(self.slots[GATE], x)
            up = adapters.delta(self.slots[UP], x)
            if gate is not None or up is not None:
                zeros = x.new_zeros(x.shape[0], self.slots[GATE].out_features)
                h = h + self._fuse(zeros if gate is None else gate, zeros if up is None else up)
        else:
            up = adapters.delta(self.slots[PLAIN_UP], x)
            h = h if up is None else h + up
        h = self._activation(h)
        y = self._base(h, self.down_proj, self.down_proj_bias, expert, offsets)
        down = adapters.delta(self.slots[DOWN if self.layout == "gated" else PLAIN_DOWN], h)
        if down is not None:
            y = y + down
        y = y * weight.unsqueeze(-1).to(y.dtype)
        return torch.zeros_like(hidden_states).index_add(0, token, y.to(hidden_states.dtype))

    def _base(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        expert: torch.Tensor,
        offsets: torch.Tensor,
    ) -> torch.Tensor:
        """Every expert's base projection of its own pairs, one grouped GEMM."""
        y = grouped_mm(x, weight if self.is_transposed else weight.mT, offsets)
        return y if bias is None else y + bias.index_select(0, expert)


class _AdapterGroups:
    """The pairs of one call regrouped adapter-major (expert order kept within an adapter), so
    each adapter's LoRA of a projection is one grouped GEMM pair over the experts."""

    def __init__(
        self,
        names: list[str],
        ordinal: torch.Tensor | None,
        token: torch.Tensor,
        expert: torch.Tensor,
        experts: int,
    ) -> None:
        self.groups: list[tuple[str, torch.Tensor, torch.Tensor]] = []  # (name, pairs, ends)
        self.pairs = token.shape[0]
        if ordinal is None or not names:
            return
        adapter = ordinal.index_select(0, token)
        perm = torch.argsort(adapter, stable=True)
        counts = torch.bincount(adapter + 1, minlength=len(names) + 1).tolist()
        at = counts[0]  # pairs without an adapter come first
        for name, count in zip(names, counts[1:], strict=True):
            if count:
                pairs = perm[at : at + count]
                self.groups.append(
                    (name, pairs, group_ends(expert.index_select(0, pairs), experts))
                )
            at += count

    def delta(self, slot: ExpertSlot, x: torch.Tensor) -> torch.Tensor | None:
        """[pairs, out] LoRA deltas of `slot` for the pairs' inputs x (zeros for pairs whose
        adapter does not train it); None when no pair's adapter does.

        The GEMMs run in x's dtype, the base weights' (adapters stay fp32; their gradients
        accumulate in fp32): in bf16 that is the grouped kernel's fast path, where fp32
        operands fall back to one launch per expert and adapter."""
        where, parts = [], []
        for name, pairs, ends in self.groups:
            if name not in slot.lora_A:
                continue
            a = slot.lora_A[name].to(x.dtype)  # [E, r, in]
            b = slot.lora_B[name].to(x.dtype)  # [E, out, r]
            h = grouped_mm(x.index_select(0, pairs), a.mT, ends)
            parts.append(grouped_mm(h * slot.scale[name], b.mT, ends))
            where.append(pairs)
        if not parts:
            return None
        out = x.new_zeros(self.pairs, slot.out_features)
        return out.index_copy(0, torch.cat(where), torch.cat(parts))


def group_ends(sorted_groups: torch.Tensor, groups: int) -> torch.Tensor:
    """int32 end offset of each group's run in a sorted group index (empty groups included)."""
    return torch.bincount(sorted_groups, minlength=groups).cumsum(0).to(torch.int32)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """x [m, k] in runs of rows (group g: rows ends[g-1]..ends[g]-1) @ w [G, k, n] -> [m, n].

    torch's grouped GEMM kernel where it takes the operands (16-byte aligned strides; CUDA
    needs sm80+), else one matmul per non-empty group."""
    if GROUPED_KERNEL and _kernel_takes(x, w):
        return torch._grouped_mm(x, w, offs=ends)
    parts, start = [], 0
    for g, end in enumerate(ends.tolist()):
        if end > start:
            parts.append(x[start:end] @ w[g])
        start = end
    return torch.cat(parts) if parts else x.new_zeros(0, w.shape[-1])


def _kernel_takes(*operands: torch.Tensor) -> bool:
    if operands[0].is_cuda and torch.cuda.get_device_capability(operands[0].device) < (8, 0):
        return False
    for t in operands:
        if t.data_ptr() % 16 or t.dtype != operands[0].dtype:
            return False
        for size, stride in zip(t.shape, t.stride(), strict=True):
            if size > 1 and stride != 1 and (stride * t.element_size()) % 16:
                return False
    return True
